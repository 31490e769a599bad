"""Which sequences go into which micro-batch, and into which packed row: the orders and cuts that
batching.py (sequences), shared_prompts.py (a prompt and its responses) and the reference model lay out.
Lengths in, index lists out; nothing here touches tensors."""

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


def padded_peak(lengths: list[int], budget: int) -> int:
    """The most token slots (rows x width) any padded chunk of `lengths` holds at `budget`
    (length_sorted_chunks): what a padded step's largest micro-batch computes on."""
    return max((len(chunk) * max(lengths[i] for i in chunk) for chunk in length_sorted_chunks(lengths, budget)),
               default=0)


def packed_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Indices laid into rows of `width` tokens, longest first, each into the first row it fits (first-fit
    decreasing); each row lists its indices in order of placement."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, load in enumerate(loads) if load + lengths[index] <= width), None)
        if row is None:
            rows.append([])
            loads.append(0)
            row = len(rows) - 1
        rows[row].append(index)
        loads[row] += lengths[index]
    return rows


def packed_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices cut into packed micro-batches whose rows (packed_inputs: as wide as the micro-batch's
    longest sequence, filled first-fit longest first) hold at most `budget` token slots in all, rows x
    width, as a padded chunk of the same budget does (length_sorted_chunks): memory and attention follow
    the budget either way, and a packed micro-batch carries more tokens in them.

    Each micro-batch starts from the longest sequence left, which sets its width; the others, longest
    first, go into the first row they fit, else into a new row while rows x width stays within the
    budget, else they wait for a later micro-batch (a shorter one may still fill a gap). A sequence
    longer than the budget gets a micro-batch of its own. Each micro-batch lists its indices in
    ascending order; the micro-batches come narrowest first, the widest last, as padded chunks do: on a
    CPU rank a step whose widest micro-batch ran first peaked 0.2-0.6 GiB higher (glibc's heap, carved for
    it, served the narrower ones badly; benchmarks/studies/train_memory.md). `budget` 0: one
    micro-batch, in arrival order.

    The budget a packed micro-batch may fill is the largest padded chunk of the same lengths
    (`padded_peak`), when that is smaller: packing never holds more token slots at once than the
    padded path would, so a step's peak memory does not grow with it. (A padded chunk often stops
    short of the budget: one at the length cap stands alone where a packed one adds a second row.)"""
    if not budget:
        return [list(range(len(lengths)))] if lengths else []
    budget = min(budget, padded_peak(lengths, budget))
    left = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks: list[list[int]] = []
    while left:
        width = lengths[left[0]]
        members, loads, waiting = [left[0]], [width], []
        for index in left[1:]:
            length = lengths[index]
            row = next((r for r, load in enumerate(loads) if load + length <= width), None)
            if row is not None:
                loads[row] += length
            elif (len(loads) + 1) * width <= budget:
                loads.append(length)
            else:
                waiting.append(index)
                continue
            members.append(index)
        chunks.append(sorted(members))
        left = waiting
    return chunks[::-1]  # narrowest first, as padded chunks run (see the docstring)
