"""Where weights go on their way into a vLLM engine's workers: a folder per engine (in /dev/shm where it exists)
holding the update file being loaded, and the LoRA adapters' folders (operators/engines/adapters.py); and the
clean-up of the folders of engines that died. Moved out of operators/engines/vllm.py, which uses it."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
import time
from typing import Mapping

import numpy as np

from operators.weights.buckets import WeightSet, as_weight_set

WEIGHT_DIR_PREFIX = "streamrl-weights-"
OWNER_LOCK = "owner.lock"  # flock-ed by the engine that owns the folder, for as long as its process lives
ORPHAN_AGE_S = 60.0  # a folder younger than this may be one whose owner has not taken its lock yet


class WeightFile:
    """Where weights go on their way into the workers: one safetensors file per update, removed once the
    workers have loaded it (tmpfs /dev/shm where it exists, so the write is a memory copy, and the file
    holds RAM until removed).

    An engine killed with SIGKILL (Ray's OOM killer, a lost node's actors) cannot remove its folder, and
    in /dev/shm a left-over folder holds up to two copies of the model in RAM until the machine restarts:
    the next attempt then runs out of memory sooner. So each folder carries a lock its owner holds while
    it lives (an flock, released by the kernel when the process dies, whatever its pid namespace), and a
    new WeightFile removes the folders whose lock it can take."""

    def __init__(self, base: str | None = None, echo=print):
        if base is None:
            shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
            base = "/dev/shm" if shm else tempfile.gettempdir()
        removed = remove_orphan_weight_dirs(base)
        if removed[0]:
            echo(f"streamrl: removed {removed[0]} weight folder(s) left in {base} by vLLM engines that died "
                 f"({removed[1] / 2**30:.2f} GiB of memory freed)")
        self.dir = tempfile.TemporaryDirectory(prefix=WEIGHT_DIR_PREFIX, dir=base)
        self._lock = open(os.path.join(self.dir.name, OWNER_LOCK), "w")  # noqa: SIM115 (held until close)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.count = 0

    def write(self, weights: WeightSet | Mapping[str, np.ndarray]) -> str:
        """The weights' buckets into the file as they are (bf16 stays bf16; vLLM casts to its dtype)."""
        self.count += 1
        path = os.path.join(self.dir.name, f"weights-{self.count % 2}.safetensors")  # two: one may be loading
        as_weight_set(weights).write_safetensors(path)
        return path

    @staticmethod
    def release(path: str) -> None:
        """The workers have loaded `path`: give its memory back (a worker that still maps it keeps its pages)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        self._lock.close()
        self.dir.cleanup()


def remove_orphan_weight_dirs(base: str, min_age_s: float = ORPHAN_AGE_S) -> tuple[int, int]:
    """Remove the weight folders in `base` whose owner died (their lock is free); (folders, bytes) removed.
    Folders without a lock file (written by another version) and those younger than `min_age_s` are kept."""
    removed = freed = 0
    for folder in glob.glob(os.path.join(base, WEIGHT_DIR_PREFIX + "*")):
        lock_path = os.path.join(folder, OWNER_LOCK)
        try:
            if time.time() - os.stat(lock_path).st_mtime < min_age_s:
                continue
            lock = open(lock_path)  # noqa: SIM115
        except OSError:
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its owner is alive
                continue
            size = sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
            shutil.rmtree(folder, ignore_errors=True)
        removed, freed = removed + 1, freed + size
    return removed, freed
