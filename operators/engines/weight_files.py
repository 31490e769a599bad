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
from typing import Callable, Mapping

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

    def __init__(self, base: str | None = None, echo=print, disk: str | None = None,
                 free_bytes: Callable[[str], int] = lambda folder: shutil.disk_usage(folder).free):
        """`base`: where the folder goes (default /dev/shm where it is writable, else the temp folder); `disk`:
        where updates go when `base` has no room for one (default the temp folder); `free_bytes(folder)`: the
        room left in a folder (shutil.disk_usage; a test gives a smaller one)."""
        if base is None:
            shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
            base = "/dev/shm" if shm else tempfile.gettempdir()
        self.echo, self.free_bytes = echo, free_bytes
        self.dir, self._lock = owned_folder(base, echo)
        self.disk_base = disk or tempfile.gettempdir()
        self.disk_dir = self._disk_lock = None  # made the first time `base` has no room for an update
        self.count = 0

    def write(self, weights: WeightSet | Mapping[str, np.ndarray]) -> str:
        """The weights' buckets into the file as they are (bf16 stays bf16; vLLM casts to its dtype), in the
        engine's folder, or on disk when that has no room for them (WeightRoomError when neither has)."""
        weights = as_weight_set(weights)
        self.count += 1
        folder = self.folder_for(weights.nbytes)
        path = os.path.join(folder, f"weights-{self.count % 2}.safetensors")  # two: one may be loading
        weights.write_safetensors(path)
        return path

    def folder_for(self, nbytes: int) -> str:
        """A folder with room for an update of `nbytes`: the engine's own (in /dev/shm, RAM) while it has room
        (the file is removed once loaded, so each update finds it empty again unless another process filled
        it), else one on disk, said once. On the object-store plane every engine of a machine writes each
        version there at about the same time: 7 versions in flight of a 7B model are ~105 GB of tmpfs, more than
        most containers' /dev/shm."""
        need = nbytes + HEADER_ROOM
        if self.free_bytes(self.dir.name) >= need:
            return self.dir.name
        if self.disk_dir is None and os.path.realpath(self.disk_base) != os.path.realpath(os.path.dirname(self.dir.name)):
            if self.free_bytes(self.disk_base) >= need:
                self.disk_dir, self._disk_lock = owned_folder(self.disk_base, self.echo)
                self.echo(f"streamrl: {os.path.dirname(self.dir.name)} has {self.free_bytes(self.dir.name) / 2**20:.0f} "
                          f"MB free, less than a weight update ({nbytes / 2**20:.0f} MB): this engine writes its "
                          f"updates to {self.disk_base} (disk) while that lasts")
        if self.disk_dir is not None and self.free_bytes(self.disk_dir.name) >= need:
            return self.disk_dir.name
        raise WeightRoomError(
            f"no room for a weight update of {nbytes / 2**20:.0f} MB: {os.path.dirname(self.dir.name)} has "
            f"{self.free_bytes(self.dir.name) / 2**20:.0f} MB free and {self.disk_base} "
            f"{self.free_bytes(self.disk_base) / 2**20:.0f} MB. Give /dev/shm more room (docker run --shm-size; "
            "Kubernetes: a larger emptyDir with medium: Memory), or free disk in the temp folder (TMPDIR)")

    @staticmethod
    def release(path: str) -> None:
        """The workers have loaded `path`: give its memory back (a worker that still maps it keeps its pages)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        for lock, folder in ((self._lock, self.dir), (self._disk_lock, self.disk_dir)):
            if folder is not None:
                lock.close()
                folder.cleanup()


class WeightRoomError(OSError):
    """Neither /dev/shm nor the temp folder has room for a weight update."""


HEADER_ROOM = 1 << 20  # a safetensors header and the file system's blocks, over the tensors' bytes


def owned_folder(base: str, echo) -> tuple[tempfile.TemporaryDirectory, object]:
    """A new weight folder in `base` and the lock its owner holds while it lives (see WeightFile), after the
    folders of engines that died there are removed."""
    removed = remove_orphan_weight_dirs(base)
    if removed[0]:
        echo(f"streamrl: removed {removed[0]} weight folder(s) left in {base} by vLLM engines that died "
             f"({removed[1] / 2**30:.2f} GiB of memory freed)")
    folder = tempfile.TemporaryDirectory(prefix=WEIGHT_DIR_PREFIX, dir=base)
    lock = open(os.path.join(folder.name, OWNER_LOCK), "w")  # noqa: SIM115 (held until close)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return folder, lock


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
