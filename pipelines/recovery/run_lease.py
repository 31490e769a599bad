"""One writer per run: a lease on the run's folder, kept alive by a heartbeat, and a fencing token
checked before every checkpoint commit.

Two `--resume latest` processes, or a RayJob retry while the old driver still lives, would otherwise
both write one run: the second removes the first's checkpoint in progress (`clean_partial`) and both
append to its MLflow spool. So a driver takes the run's lease before it touches the folder:

    <output_dir>/checkpoints/<run_id>/lease.json   owner, pid, host, token, heartbeat

The holder rewrites `heartbeat` every `ttl_s / 3`. Another process that finds the lease held waits
until it can tell: the lease is free when its holder released it, when the holder is a dead process
on this host, or when the heartbeat stops changing for `ttl_s` (watched on this process's own clock,
so no two machines' clocks are compared). A live holder makes it refuse, naming who holds the run.
Taking the lease raises its token by one; the Train operator checks the token it was started with
before each checkpoint commit (`Fence.check`), so a writer that lost the lease (its heartbeat stalled
past `ttl_s`, another took over) commits nothing more. Acquisition runs under an `flock` on
`.lease.lock` beside it (on shared storage, one whose `flock` is coherent across machines: local
disk, NFSv4, Lustre, most cluster filesystems).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from operators.common.durable import write_json_atomic

LEASE_FILE = "lease.json"
LOCK_FILE = ".lease.lock"
TTL_S = 30.0


class LeaseHeld(RuntimeError):
    """Another live process writes this run."""


class LeaseLost(RuntimeError):
    """This process's lease was taken by another: it must stop writing the run."""


def _read(path: Path) -> dict | None:
    try:
        lease = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or torn by hand: nobody can be proven to hold it
        return None
    return lease if isinstance(lease, dict) else None


@contextlib.contextmanager
def _locked(folder: Path):
    with open(folder / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _dead_here(lease: dict) -> bool:
    """The holder is a process of this host that no longer runs."""
    if lease.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


def holder(lease: dict) -> str:
    return f"pid {lease.get('pid')} on {lease.get('host')}"


@dataclass(frozen=True)
class Fence:
    """What a writer of the run checks before it commits (picklable: it travels to the Train actor)."""

    lease_file: str
    token: int

    def check(self) -> None:
        lease = _read(Path(self.lease_file)) or {}
        if lease.get("token") != self.token:
            raise LeaseLost(f"another process took over this run ({holder(lease)}, lease token {lease.get('token')}, "
                            f"this writer's {self.token}); this writer stops without committing")


class RunLease:
    """The lease on one run folder. `acquire()` before touching it, `release()` at the end."""

    def __init__(self, folder: Path, ttl_s: float = TTL_S, echo: Callable[[str], None] = print):
        self.folder, self.ttl_s, self.echo = Path(folder), ttl_s, echo
        self.path = self.folder / LEASE_FILE
        self.owner = uuid.uuid4().hex
        self.token: int | None = None
        self.lost: str | None = None  # why the lease was lost, once it was
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def fence(self) -> Fence:
        return Fence(str(self.path), self.token)

    def acquire(self) -> "RunLease":
        """Take the lease (waiting up to `ttl_s` to tell a live holder from a dead one); LeaseHeld if live."""
        self.folder.mkdir(parents=True, exist_ok=True)
        seen, since = None, time.monotonic()
        while True:
            with _locked(self.folder):
                lease = _read(self.path)
                if lease is None or self._free(lease, seen, since):
                    if lease and not lease.get("released"):
                        self.echo(f"streamrl: took over run {self.folder.name} from {holder(lease)}, whose lease "
                                  f"lapsed (no heartbeat for {self.ttl_s:g}s, or the process is gone)")
                    self.token = int((lease or {}).get("token", 0)) + 1
                    self._write()
                    break
            if seen is None or lease.get("heartbeat") != seen:
                if seen is not None:  # it moved: the holder lives
                    raise LeaseHeld(f"run {self.folder.name} is being written by {holder(lease)} (its lease "
                                    f"{self.path} is renewed every {self.ttl_s / 3:g}s); stop that job first, or "
                                    "start a new run without --resume")
                seen, since = lease.get("heartbeat"), time.monotonic()
                self.echo(f"streamrl: run {self.folder.name} has a lease held by {holder(lease)}; waiting up to "
                          f"{self.ttl_s:g}s to see whether it is alive")
            time.sleep(min(1.0, self.ttl_s / 10))
        self._beat = threading.Thread(target=self._heartbeat, name="streamrl-run-lease", daemon=True)
        self._beat.start()
        return self

    def _free(self, lease: dict, seen, since: float) -> bool:
        if lease.get("released") or _dead_here(lease):
            return True
        # unchanged for a whole ttl on our clock, or older than three by the holder's own
        if seen is not None and lease.get("heartbeat") == seen and time.monotonic() - since >= self.ttl_s:
            return True
        heartbeat = lease.get("heartbeat")
        return isinstance(heartbeat, (int, float)) and time.time() - heartbeat > 3 * self.ttl_s

    def _write(self, released: bool = False) -> None:
        write_json_atomic(self.path, {"owner": self.owner, "token": self.token, "pid": os.getpid(),
                                      "host": socket.gethostname(), "heartbeat": time.time(),
                                      "ttl_s": self.ttl_s, "released": released})

    def _heartbeat(self) -> None:
        failing = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with _locked(self.folder):
                    lease = _read(self.path) or {}
                    if lease.get("token") != self.token:
                        self.lost = f"{holder(lease)} took over run {self.folder.name} (lease token {lease.get('token')})"
                        return
                    self._write()
                if failing:
                    self.echo(f"streamrl: lease {self.path} renewed again")
                failing = False
            except OSError as err:  # a full disk, a flaky mount: try again next beat; ttl_s gives us time
                if not failing:
                    self.echo(f"streamrl: could not renew the lease {self.path} ({err}); retrying every "
                              f"{self.ttl_s / 3:g}s")
                failing = True

    def check(self) -> None:
        """Raise LeaseLost if another process took the run."""
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5)
        if self.token is None:
            return
        with contextlib.suppress(OSError), _locked(self.folder):
            lease = _read(self.path) or {}
            if lease.get("token") == self.token:
                self._write(released=True)
        self.token = None
