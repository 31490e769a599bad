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
