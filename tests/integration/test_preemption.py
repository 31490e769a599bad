"""The driver's SIGTERM handling (pipelines/recovery/preemption.py), with real signals to this process; the whole
job stopped by SIGTERM and resumed is in tests/e2e/test_faults.py."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from pipelines.recovery.preemption import Preempted, Preemption, interrupt_main_thread, interruptible_main_thread


def _wait_for_signal(seconds: float = 10.0) -> None:
    """Python runs a signal handler between bytecodes of the main thread: give it some."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def _block_like_the_dag(late: threading.Event, seconds: float = 20.0) -> None:
    """What the driver's main thread does while Ray Data waits for a block: an untimed Condition.wait,
    no bytecodes run. After `seconds` a thread sets `late` and ends the wait, so an interrupt that does
    not end the wait fails the test (late is set) instead of hanging it."""
    waiting: queue.Queue = queue.Queue()

    def end_the_wait():
        time.sleep(seconds)
        late.set()
        waiting.put("the wait ended by itself")

    threading.Thread(target=end_the_wait, daemon=True).start()
    waiting.get()


def test_interrupt_main_thread_ends_an_untimed_wait():
    late = threading.Event()
    threading.Timer(0.2, interrupt_main_thread).start()
    with pytest.raises(KeyboardInterrupt), interruptible_main_thread():  # pytest may run with SIGINT ignored
        _block_like_the_dag(late)
    assert not late.is_set()  # _thread.interrupt_main() alone waited here until the wait ended


# A driver started with SIGINT ignored, as a background job of a script (`streamrl run ... &`) is: the node
# watch's interrupt and the grace watchdog must still end its untimed wait, and SIGINT from outside must
# stay ignored. Then SIGINT at the OS default (a library may set it): the interrupt still ends the wait, and
# an outside SIGINT still ends the process.
_IGNORED_SIGINT_DRIVER = """
import os, queue, signal, threading
from pipelines.recovery.preemption import Preemption, interrupt_main_thread, interruptible_main_thread
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN, signal.getsignal(signal.SIGINT)
with interruptible_main_thread():
    os.kill(os.getpid(), signal.SIGINT)  # from outside: ignored, as the process was started
    print("outside SIGINT ignored", flush=True)
    threading.Timer(0.2, interrupt_main_thread).start()  # the node watch's way
    try:
        queue.Queue().get()  # untimed: only an interrupt ends it
    except KeyboardInterrupt:
        print("node watch interrupt ended the wait", flush=True)
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
lines = []
try:
    with Preemption("finish_step", 0.5, lines.append) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        queue.Queue().get()  # a step that never ends
except KeyboardInterrupt:
    print("grace watchdog ended the wait:", preemption.grace_expired, flush=True)
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
print("SIGINT ignored again", flush=True)
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a library's choice: SIGINT ends the process
with interruptible_main_thread():
    threading.Timer(0.2, interrupt_main_thread).start()
    try:
        queue.Queue().get()
    except KeyboardInterrupt:
        print("interrupt ended the wait at the OS default", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # from outside: the process ends, as at the OS default
    queue.Queue().get()
"""


def test_the_interrupts_end_a_wait_in_a_driver_started_with_sigint_ignored():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _IGNORED_SIGINT_DRIVER], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2],
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert done.returncode == -signal.SIGINT, done.stderr[-3000:]  # the last, outside SIGINT at the OS default
    assert done.stdout.splitlines() == ["outside SIGINT ignored", "node watch interrupt ended the wait",
                                        "grace watchdog ended the wait: True", "SIGINT ignored again",
                                        "interrupt ended the wait at the OS default"], done.stdout


def test_abandon_step_stops_at_once_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    lines = []
    with pytest.raises(Preempted) as stopped:
        with Preemption("abandon_step", 25, lines.append):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_signal()
    assert not stopped.value.finished_step and "abandon_step" in lines[0]
    assert signal.getsignal(signal.SIGTERM) is before


def test_finish_step_sets_the_flag_the_train_operator_reads_and_a_second_signal_stops_now(ray_cluster):
    lines = []
    preemption = Preemption("finish_step", 25, lines.append)
    with pytest.raises(KeyboardInterrupt):
        with preemption:
            request = preemption.stop_request()
            assert not request.requested()
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_signal(0.2)  # the first signal only asks: nothing is raised
            assert request.requested() and preemption.requested_at is not None
            assert 0 < preemption.remaining_s() <= 25
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_signal()
    assert "finishing the step in progress" in lines[0] and "second SIGTERM" in lines[1]
    assert not preemption.grace_expired


def test_a_step_that_outlasts_the_grace_period_is_abandoned():
    lines, late = [], threading.Event()
    preemption = Preemption("finish_step", 0.5, lines.append)
    with pytest.raises(KeyboardInterrupt):
        with preemption:
            os.kill(os.getpid(), signal.SIGTERM)
            _block_like_the_dag(late)  # a step that never ends
    assert preemption.grace_expired and "grace period" in lines[-1] and not late.is_set()


def test_a_disarmed_stop_is_not_interrupted_by_the_watchdog():
    preemption = Preemption("finish_step", 0.5, lambda line: None)
    with preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_signal(0.1)
        preemption.disarm()  # the job is cleaning up after its checkpoint
        _wait_for_signal(1.5)
    assert not preemption.grace_expired
