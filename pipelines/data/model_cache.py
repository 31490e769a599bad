"""The cache of the models streamrl makes itself (the builtins, `builtin:<name>`: pipelines/data/models.py):
where it is (STREAMRL_CACHE), how a folder in it is named (a hash of every build parameter), and
`build_cached`, which builds one once and never leaves a half-built folder under its final name.

Standard library only at the top: config checks name cached folders (pipelines/data/smollm2.py) without
importing torch, which only a build needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

BUILTIN_PREFIX = "builtin:"
MARKER_FILE = "STREAMRL_BUILD_COMPLETE.json"  # a built folder's manifest, written last


def default_cache_dir() -> Path:
    root = os.environ.get("STREAMRL_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    return Path("~/.cache/streamrl/models").expanduser()


def cache_root(cache_dir: str | Path | None) -> Path:
    """`cache_dir` if one is given, else the default cache (read now: STREAMRL_CACHE may change)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _params_hash(params: dict[str, Any]) -> str:
    blob = json.dumps(params, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_folder(cache_dir: str | Path | None, prefix: str, params: dict[str, Any]) -> Path:
    """`cache/<prefix>-<hash of params>`: where `build_cached` puts the build of `params`."""
    return cache_root(cache_dir) / f"{prefix}-{_params_hash(params)}"


def _is_complete(path: Path) -> bool:
    return (path / MARKER_FILE).is_file()


def built_folder(cache_dir: str | Path | None, prefix: str, params: dict[str, Any]) -> str | None:
    """The build of `params` when `build_cached` has finished it (config checks read it), else None."""
    folder = cached_folder(cache_dir, prefix, params)
    return str(folder) if _is_complete(folder) else None


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def build_cached(cache_dir: str | Path | None, prefix: str, params: dict[str, Any], make_tokenizer, build,
                 threads: int) -> Path:
    """`cache/<prefix>-<hash of params>`, built by `build(folder, params, tokenizer)` if it is not there yet:
    in a temporary sibling, renamed into place with the marker file written last (a crash never leaves a
    half-built folder under the final name), with `threads` torch threads and the caller's RNG untouched."""
    import torch

    final = cached_folder(cache_dir, prefix, params)
    cache = final.parent
    if _is_complete(final):
        return final

    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        # fixed thread count and seeds: deterministic; the caller's RNG is untouched
        with _torch_threads(threads), torch.random.fork_rng(devices=[]):
            info = build(tmp, params, tokenizer)
        marker = {"params": params, **info, "built_at": time.time()}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final, ignore_errors=True)  # no marker: an older layout, or a copy cut short
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final):  # someone else won a race with a good copy
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
