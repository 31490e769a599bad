"""Packing sequences of long-tailed lengths into padded batches (the trainer's micro-batches, the
reference model's chunks)."""

from __future__ import annotations


def length_sorted_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices sorted by length, cut so that no chunk pads to more than `budget` tokens (chunk size x
    its longest sequence); a sequence longer than the budget gets a chunk of its own. On long-tailed
    lengths this removes most padding: short sequences no longer pad to the longest one."""
    chunks, current, width = [], [], 0
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        grown = max(width, lengths[index])
        if current and grown * (len(current) + 1) > budget:
            chunks.append(current)
            current, grown = [], lengths[index]
        current.append(index)
        width = grown
    return chunks + ([current] if current else [])


def split_to_count(chunks: list[list[int]], count: int) -> list[list[int]]:
    """`chunks` cut further until there are `count` of them: the largest is halved (its halves keep the
    order inside it, so length-sorted chunks stay sorted); once every chunk holds one index, empty
    chunks ([]) make up the rest. Ranks of a ZeRO-3 group use it to run the same number of passes."""
    chunks = [list(chunk) for chunk in chunks]
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: len(chunks[i]), default=None)
        if largest is None or len(chunks[largest]) <= 1:
            chunks.extend([] for _ in range(count - len(chunks)))
            break
        chunk = chunks[largest]
        chunks[largest:largest + 1] = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
    return chunks


def balanced_shards(lengths: list[int], parts: int, equal_counts: bool = False) -> list[list[int]]:
    """Indices of `lengths` dealt to `parts` ranks so each rank gets about the same number of tokens
    (a rank's compute and memory follow its tokens, not its sample count). Each shard lists its indices
    in ascending order.

    Default: longest first, each to the rank with the fewest tokens so far (list scheduling), so the
    ranks' token counts differ by at most one sample's length, and every rank gets a sample when there
    are at least `parts`. `equal_counts`: every rank gets len / parts samples (callers that cut each
    rank's samples into equal mini-batches need it), dealt longest first in snake order (0..P-1, P-1..0,
    ...), which keeps token counts close without the bound above."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards: list[list[int]] = [[] for _ in range(parts)]
    if equal_counts:
        for position, index in enumerate(order):
            lap, offset = divmod(position, parts)
            shards[offset if lap % 2 == 0 else parts - 1 - offset].append(index)
    else:
        loads = [0] * parts
        for index in order:
            rank = min(range(parts), key=lambda r: (loads[r], len(shards[r]), r))
            shards[rank].append(index)
            loads[rank] += lengths[index]
    return [sorted(shard) for shard in shards]
