"""Host buffers for weight buckets, reused from one publish to the next (operators/weights/buckets.py packs into
them on the trainer's rank 0)."""

from __future__ import annotations

import threading
import weakref

import numpy as np


class _Slot:
    """One reusable host buffer: free, being packed, or handed out (free again once its array is gone)."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.packing = True
        self._out = None  # weakref to the numpy array handed out

    def free(self) -> bool:
        return not self.packing and (self._out is None or self._out() is None)

    def hand_out(self, array: np.ndarray) -> None:
        self._out = weakref.ref(array)
        self.packing = False

    def release(self) -> None:
        """Free again without handing anything out: a pack or a receive that failed or was abandoned midway
        (without this the slot stayed marked in use for the life of the process)."""
        self._out = None
        self.packing = False


class BucketBuffers:
    """Host buffers for weight buckets, kept from one publish to the next and reused once nothing holds
    an array made from them (the weight sender drops a version when the next one replaces it).

    Why: a fresh host buffer pays a page fault per page on first touch. Packing SmolLM2-135M's 651 MB
    (fp32) into fresh buffers took 0.72 s on the 2-core CPU machine, into reused ones 0.067 s, and the
    trainer ranks wait for the pack (benchmarks/studies/weight_update.md). Rank 0 holds about two
    versions' buffers: the one the sender keeps for engines that join, and the one being packed.

    Whether a buffer is still in use is read from a weak reference to the numpy array made from it:
    numpy points every view of that array (slices, dtype views) at it, and `torch.from_numpy` keeps
    the array it was given, so the array dies only when the last of them does."""

    def __init__(self, pin_memory: bool = False):
        # pin_memory: page-locked buffers (CUDA hosts), so a GPU-to-host copy into them is one DMA
        # instead of a copy through a staging buffer (benchmarks/gpu_smoke.py measures both)
        self.pin_memory = pin_memory
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()

    def take(self, torch_dtype, elements: int) -> _Slot:
        """A free buffer of `torch_dtype` with at least `elements` (the smallest that fits), else a new one."""
        import torch

        with self._lock:
            fits = [slot for slot in self._slots
                    if slot.free() and slot.buffer.dtype == torch_dtype and slot.buffer.numel() >= elements]
            if fits:
                slot = min(fits, key=lambda s: s.buffer.numel())
                slot.packing = True
                return slot
            slot = _Slot(torch.empty(elements, dtype=torch_dtype, pin_memory=self.pin_memory))
            self._slots.append(slot)
            return slot

    @property
    def nbytes(self) -> int:
        """Host bytes held, in use or free."""
        return sum(slot.buffer.numel() * slot.buffer.element_size() for slot in self._slots)
