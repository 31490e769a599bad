"""The stall report (pipelines/runtime/stall.py) on a real Ray session: with no step for a while, it says what
the job waits on (an actor that cannot be placed, the policy version, the stacks), then again after twice as
long; a step resets it, and stop ends it."""

from __future__ import annotations

import threading
import time

import ray as ray_module

from pipelines.runtime.policy_store import create_policy_store
from pipelines.runtime.stall import StallReport


@ray_module.remote(num_cpus=0)
class Sleeper:
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)


@ray_module.remote(num_cpus=64)  # more than the 2-CPU test cluster has: stays PENDING_CREATION
class TooBig:
    def ping(self) -> None:
        pass


def wait_for(predicate, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_report_names_what_waits_then_backs_off(ray_cluster):
    store = create_policy_store("streamrl-policy-stall-test")
    sleeper, too_big = Sleeper.remote(), TooBig.remote()
    ray_module.get(sleeper.nap.remote(0))  # alive, with a pid
    lines: list[str] = []
    said = threading.Event()

    def echo(text: str) -> None:
        lines.append(text)
        said.set()

    report = StallReport(after_s=1.0, echo=echo, store=store, poll_s=0.05).start()
    try:
        report.beat(3)
        assert said.wait(120), "no report"
        first = lines[0]
        assert "no step for" in first and "since step 3" in first
        assert "free/total: CPU" in first
        assert "TooBig pending_creation" in first and "not running yet" in first
        assert "Sleeper alive" in first
        assert "policy store: newest version 0" in first
        assert "driver threads:" in first and "MainThread" in first
        assert "Sleeper (pid" in first  # py-spy (the dev extra) dumps the live actors' stacks
        # backs off: the second report only after twice the first wait (2 s since the beat); a beat resets it
        wait_for(lambda: report.reports >= 2)
        assert "the next report at 4s" in lines[1]
        report.beat(4)
        count = report.reports
        assert report.next_s == 1.0
        wait_for(lambda: report.reports > count)
        assert "since step 4" in lines[-1]
    finally:
        report.stop()
        for actor in (sleeper, too_big):
            ray_module.kill(actor)
        store.kill()
    count = report.reports
    time.sleep(1.5)
    assert report.reports == count  # stopped: no report after stop


def test_off_when_zero():
    report = StallReport(after_s=0, echo=print, poll_s=0.01).start()
    assert "streamrl-stall-report" not in {thread.name for thread in threading.enumerate()}
    report.stop()
