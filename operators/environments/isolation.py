"""What the sandbox's child (operators/environments/sandbox.py) runs inside on this machine: the command
prefix, found once per process, and the line that says what it protects.

- bubblewrap (`bwrap`), where it is installed and works: a user namespace of its own; the whole filesystem
  read-only (`--ro-bind / /`) but a private /tmp and /dev (tmpfs, gone with the child); no network
  (`--unshare-net`: a network namespace with only its own loopback) unless the network is allowed. The code's
  folders that lie under /tmp (a clone or a virtualenv there, Ray's working_dir, a test's module) are bound
  back read-only, or the child could not import what it runs.
- else `unshare -rn`, where an unprivileged process may make a user and a network namespace: no network, no
  filesystem isolation;
- else neither: only what the sandbox does itself (rlimits, a scrubbed environment, JSON replies).

No pid namespace: a pid seen in the child is the pid the job sees (the sandbox's children are found and
reaped by pid), and the kill of the child's process group reaches bwrap and everything under it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

APPLIES = "rlimits, a scrubbed environment and JSON replies apply"
HOW_TO_GET_BWRAP = "apt-get install bubblewrap, or your distribution's bubblewrap package"
PRIVATE = "/tmp"


def bwrap_args(bwrap: str, isolate_network: bool) -> tuple[str, ...]:
    """bwrap's options before the per-start binds and `--`."""
    return (bwrap, "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev",
            "--tmpfs", PRIVATE, *(("--unshare-net",) if isolate_network else ()))


def code_binds() -> list[str]:
    """`--ro-bind P P` for each folder under /tmp the child's interpreter and imports need: this process's
    interpreter and prefix, its sys.path and its working folder (read now: Ray adds a job's working_dir to
    sys.path after start-up). /tmp itself is never bound back: that would undo the private /tmp."""
    try:
        cwd = os.getcwd()
    except OSError:  # removed under us: the child starts elsewhere
        cwd = ""
    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, os.path.dirname(sys.executable), cwd, *sys.path,
                  *import_roots()]
    folders = set()
    for path in candidates:
        if not path:
            continue
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if form.startswith(PRIVATE + "/") and os.path.exists(form):
                folders.add(form)
    binds: list[str] = []
    for folder in sorted(folders):  # a parent before its children
        binds += ["--ro-bind", folder, folder]
    return binds


def import_roots() -> set[str]:
    """The folders this process's top-level modules were imported from. An editable install (setuptools'
    finder, as `pip install -e .` makes for streamrl) resolves its packages through an import hook, not a
    sys.path entry: a checkout under /tmp is reached only through its modules' own files."""
    roots = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if "." in name or not file:
            continue
        folder = os.path.dirname(os.path.abspath(file))
        roots.add(os.path.dirname(folder) if os.path.basename(file) == "__init__.py" else folder)
    return roots


def child_prefix(prefix: tuple[str, ...]) -> list[str]:
    """The prefix of one child's command line: `isolation()`'s, with bwrap's binds of the moment."""
    if not uses_bwrap(prefix):
        return list(prefix)
    return [*prefix[:-1], *code_binds(), prefix[-1]]


def uses_bwrap(prefix: tuple[str, ...]) -> bool:
    return bool(prefix) and Path(prefix[0]).name == "bwrap"


def _runs(command: list[str]) -> str | None:
    """None when `command` exits 0; else what went wrong, in a few words."""
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"failed: {err}"
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return f"not permitted: {lines[-1] if lines else f'exit code {probe.returncode}'}"


@functools.lru_cache(maxsize=None)
def bubblewrap(isolate_network: bool = True) -> tuple[tuple[str, ...], str | None]:
    """(bwrap's options, or () when it cannot be used here; why not). Probed once per process by starting
    this interpreter inside it, with the binds the child gets."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return (), f"bubblewrap not installed: {HOW_TO_GET_BWRAP}"
    prefix = (*bwrap_args(bwrap, isolate_network), "--")
    problem = _runs([*child_prefix(prefix), sys.executable, "-c", ""])
    return (prefix, None) if problem is None else ((), f"bwrap {problem}")


@functools.lru_cache(maxsize=None)
def isolation(isolate_network: bool = True) -> tuple[tuple[str, ...], str]:
    """(the command prefix that isolates the child (`child_prefix` adds what one start needs), or (); the
    line that says what the sandbox protects on this machine)."""
    bwrap, no_bwrap = bubblewrap(isolate_network)
    network = "network allowed (SandboxLimits.isolate_network is False)"
    if bwrap:
        files = "a read-only filesystem with a private /tmp (bubblewrap)"
        return bwrap, f"streamrl: sandbox: {'no network' if isolate_network else network}, {files}; {APPLIES}"
    files = f"no filesystem isolation ({no_bwrap})"
    if not isolate_network:
        return (), f"streamrl: sandbox: {network}, {files}; {APPLIES}"
    unshare = shutil.which("unshare")
    why = "unshare not installed" if unshare is None else _runs([unshare, "-rn", "true"])
    if why is None:
        return (unshare, "-rn", "--"), f"streamrl: sandbox: no network (own user and network namespace, " \
                                      f"unshare -rn); {files}; {APPLIES}"
    if unshare is not None:
        why = f"unshare -rn {why}"
    return (), f"streamrl: sandbox: no network or filesystem isolation on this machine ({why}; {no_bwrap}); {APPLIES}"
