"""Durable file writes: atomic (a reader sees the old file or the whole new one), fsynced (file and
folder: a crash or a reboot after the call returned keeps it), and a full disk reported as what it
is, with the space needed and where.

Used by the Train operator (each step's rollouts) and by pipelines/ (checkpoints, run files).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

MIB = 2**20
_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """Not enough space for a write. Its message says how much was needed, where, and what to do; a job
    that meets one waits for space and restarts from its last checkpoint (pipelines/recovery/attempts.py)."""


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, DiskFullError) or (isinstance(err, OSError) and err.errno in _FULL)


def free_bytes(path: Path | str) -> int:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def folder_bytes(path: Path | str) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for file in Path(path).rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:  # removed while we walked it
            pass
    return total


def space_problem(path: Path | str, needed: int, what: str) -> str | None:
    """None when `needed` bytes fit at `path`, else the sentence a DiskFullError carries."""
    free = free_bytes(path)
    if free >= needed:
        return None
    return (f"{what} needs about {needed / MIB:,.1f} MiB at {path}, and {free / MIB:,.1f} MiB are free there; "
            "free space on that disk (or lower train.checkpoint_keep, or set output_dir on a larger disk)")


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes, what: str | None = None) -> None:
    """Write `data` to `path` through a hidden temporary beside it, fsync it, rename it into place and
    fsync the folder. A full disk leaves nothing behind and raises DiskFullError naming `what`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in _FULL:
            raise DiskFullError(err.errno, space_problem(path.parent, len(data) + MIB, what or str(path))
                                or f"{what or path}: {err.strerror}") from None
        raise


def write_json_atomic(path: Path | str, payload: dict) -> None:
    write_atomic(path, json.dumps(payload, indent=1, sort_keys=True, default=str).encode())


def sha256_of(file: Path) -> str:
    """The file's SHA-256, read in 1 MiB chunks (checkpoint manifests, converted model folders)."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
