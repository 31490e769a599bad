"""A graceful stop on SIGTERM: what spot instances, `ray job stop` and Kubernetes send before they kill.

The first SIGTERM to the driver starts a stop that loses nothing and fits a grace period
(`train.preempt_grace_s`, default 25 s: inside Kubernetes' default 30 s):

* `train.on_preempt: finish_step` (default): the step being trained finishes, the Train operator
  writes a checkpoint right after it (whatever `train.checkpoint_every` says) and the job stops;
  should the grace period run out first, the job stops at once instead (as `abandon_step`).
* `train.on_preempt: abandon_step`: the job stops at once; the step in progress is dropped and the
  last checkpoint already written is where a resume starts (its steps are trained again).

Either way the MLflow records still buffered are delivered (or spooled, within what is left of the
grace period), the run is marked KILLED with the tag `stopped_by: preemption`, the command that
resumes the run is printed, and `streamrl run` exits with PREEMPTED_EXIT (75, EX_TEMPFAIL: try
again). A second SIGTERM (or Ctrl-C) stops at once, exit 130, keeping every checkpoint written.

The Train operator polls a `StopRequest` (operators import nothing of pipelines/: any object with
`requested()` will do): a channel that holds the handle of the job's flag actor, passed to the Train
stage in its constructor kwargs, never looked up by name.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable

import ray

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on a signal, resumable with the printed command


_ours = threading.Event()  # interrupt_main_thread sent the SIGINT that _raise_for_ours is about to see
_outside = [signal.SIG_IGN]  # what a SIGINT from outside does while _raise_for_ours is installed


def _raise_for_ours(signum, frame) -> None:
    """SIGINT's handler where the process had no Python handler for it: the SIGINT interrupt_main_thread
    sends raises KeyboardInterrupt; one from outside does what it did before (ignored, or the OS default:
    the process ends on SIGINT)."""
    if _ours.is_set():
        _ours.clear()
        raise KeyboardInterrupt
    if _outside[0] == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)


@contextmanager
def interruptible_main_thread():
    """Let interrupt_main_thread end the main thread's waits inside this block even where SIGINT has no
    Python handler.

    A process started in the background of a non-interactive shell (`streamrl run ... &` in a script, a
    job runner's child) inherits SIGINT ignored, and Python then installs no handler of its own: the SIGINT
    interrupt_main_thread sends was dropped by the kernel, and a node-loss restart or the preemption
    watchdog waited for ever on the DAG (seen when the test suite ran in the background). With SIGINT at the
    OS default (set by a library), `_thread.interrupt_main()` does nothing at all. Here SIGINT gets a handler
    that raises only for ours and keeps what an outside SIGINT did. Main thread only (Python runs handlers
    there); elsewhere, and where SIGINT already has a Python handler, nothing changes."""
    previous = signal.getsignal(signal.SIGINT)
    install = threading.current_thread() is threading.main_thread() and previous in (signal.SIG_IGN, signal.SIG_DFL)
    if install:
        _outside[0] = previous
        signal.signal(signal.SIGINT, _raise_for_ours)
    try:
        yield
    finally:
        if install:
            signal.signal(signal.SIGINT, previous)
            _ours.clear()


def interrupt_main_thread() -> None:
    """KeyboardInterrupt in the main thread, also while it blocks in an untimed lock or queue wait.

    `_thread.interrupt_main()` only sets the flag Python checks between bytecodes, and a main thread
    blocked in `Condition.wait()` (Ray Data's iterator waiting for a block that never comes) never
    runs one: the interrupt waited forever (seen in the node-loss test). A real SIGINT sent to the
    main thread ends the wait (EINTR) and Python runs its handler there. Where SIGINT has no Python
    handler (started ignored, or set to the OS default), that needs `interruptible_main_thread` around
    the wait (the job has it)."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is _raise_for_ours:
        _ours.set()
    if callable(handler):  # a Python handler: default_int_handler (or ours) raises KeyboardInterrupt
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    else:  # no Python handler, outside interruptible_main_thread: `_thread.interrupt_main()` would do nothing either
        logging.getLogger(__name__).warning(
            "streamrl: cannot interrupt the main thread: SIGINT has no Python handler here (run the wait inside "
            "pipelines.recovery.preemption.interruptible_main_thread)")


class Preempted(BaseException):
    """The job stopped on SIGTERM (a BaseException, like KeyboardInterrupt: no retry catches it).
    `step`: the checkpoint a resume starts from; `finished_step`: whether the step in progress was
    trained and checkpointed (finish_step) or dropped (abandon_step, or the grace period ran out)."""

    def __init__(self, message: str, finished_step: bool):
        super().__init__(message)
        self.finished_step = finished_step


@ray.remote(num_cpus=0)
class StopFlag:
    def __init__(self):
        self.set_at = None

    def set(self) -> None:
        self.set_at = self.set_at or time.time()

    def is_set(self) -> bool:
        return self.set_at is not None


class StopRequest:
    """What the Train operator asks after each step: has a graceful stop been asked for? Picklable: it
    travels to the Train stage's actor with the flag actor's handle in it."""

    def __init__(self, flag):
        self.flag = flag

    def requested(self) -> bool:
        return bool(ray.get(self.flag.is_set.remote()))


class Preemption:
    """Driver side, for the length of a job: the SIGTERM handler, the flag actor, the grace watchdog.

    Use as a context manager around the job (main thread only: Python runs signal handlers there; in
    another thread it installs nothing and the default SIGTERM behaviour stays)."""

    def __init__(self, policy: str, grace_s: float, echo: Callable[[str], None] = print):
        self.policy, self.grace_s, self.echo = policy, grace_s, echo
        self.requested_at: float | None = None
        self.grace_expired = False
        self._flag = None
        self._previous = None
        self._installed = False
        self._armed = True

    # -- the flag the Train operator reads ----------------------------------------------------

    def stop_request(self) -> StopRequest:
        """A StopRequest for this job's Train operator (the flag actor is made on first use)."""
        if self._flag is None:
            from pipelines.runtime.placement import on_this_node

            self._flag = StopFlag.options(scheduling_strategy=on_this_node()).remote()
            if self.requested_at is not None:
                self._flag.set.remote()
        return StopRequest(self._flag)

    def disarm(self) -> None:
        """The job is stopping (or has stopped): the grace watchdog must not interrupt its clean-up."""
        self._armed = False

    def remaining_s(self) -> float:
        """Seconds left of the grace period (the whole period while no stop was asked for)."""
        if self.requested_at is None:
            return self.grace_s
        return max(self.grace_s - (time.monotonic() - self.requested_at), 0.0)

    # -- the signal -----------------------------------------------------------------------------

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
            # the watchdog below, and the node watch of pipelines/recovery/attempts.py, interrupt the main thread
            self._interruptible = interruptible_main_thread()
            self._interruptible.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._flag is not None:  # the flag actor lives as long as the Ray session otherwise (a shared cluster)
            try:
                ray.kill(self._flag)
            except Exception:  # noqa: BLE001 - Ray already shut down: the actor went with it
                pass
            self._flag = None
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._interruptible.__exit__(None, None, None)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested_at is not None:  # the second signal: stop now
            self.echo("streamrl: a second SIGTERM: stopping now (checkpoints already written are kept)")
            raise KeyboardInterrupt
        self.requested_at = time.monotonic()
        if self.policy == "abandon_step":
            self.echo("streamrl: SIGTERM: stopping now, the step in progress is abandoned (train.on_preempt: "
                      "abandon_step); a resume starts from the last checkpoint")
            raise Preempted("stopped on SIGTERM; the step in progress was abandoned", finished_step=False)
        self.echo(f"streamrl: SIGTERM: finishing the step in progress, then a checkpoint and a stop "
                  f"(train.on_preempt: finish_step; at most {self.grace_s:g}s, train.preempt_grace_s)")
        if self._flag is not None:
            self._flag.set.remote()
        threading.Thread(target=self._watchdog, name="streamrl-preempt-grace", daemon=True).start()

    def _watchdog(self) -> None:
        # Leave a few seconds of the grace period for the checkpoint's end, MLflow and Ray's shut-down.
        deadline = max(self.grace_s * 0.8, self.grace_s - 5.0)
        while self.requested_at is not None and time.monotonic() - self.requested_at < deadline:
            time.sleep(0.1)
        if self._installed and self._armed:
            self.grace_expired = True
            self.echo("streamrl: the grace period is running out before the step ended: stopping now")
            interrupt_main_thread()  # the main thread waits in the DAG's iterator
