"""The driver's SIGTERM handling (pipelines/recovery/preemption.py), with real signals to this process; the whole
job stopped by SIGTERM and resumed is in tests/e2e/test_faults.py."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

from pipelines.recovery.preemption import Preempted, Preemption, interrupt_main_thread


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
    with pytest.raises(KeyboardInterrupt):
        _block_like_the_dag(late)
    assert not late.is_set()  # _thread.interrupt_main() alone waited here until the wait ended


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
