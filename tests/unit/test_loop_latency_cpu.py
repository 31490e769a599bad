"""benchmarks/loop_latency.py's CPU accounting: per-process CPU ms per step between two /proc samples."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.loop_latency import ProcessCPU


def test_cpu_per_step_is_the_difference_of_the_samples_summed_by_name():
    cpu = ProcessCPU()
    cpu.samples = [
        (10.0, {1: ("ray::Train", 1.0), 2: ("raylet", 0.5)}),
        (11.0, {1: ("ray::Train", 1.2), 2: ("raylet", 0.5), 3: ("ray::Train", 0.1)}),  # pid 3 started meanwhile
        (12.0, {1: ("ray::Train", 1.4), 2: ("raylet", 0.52), 3: ("ray::Train", 0.3)}),
    ]
    # the window holds the samples at 11 and 12: 1 s of a 2 s window, so half of its 20 steps
    use = cpu.per_step(10.5, 12.5, 20)
    assert use["window_s"] == 1.0
    assert use["ms_per_step"] == {"ray::Train": 40.0, "raylet": 2.0}  # (0.2 + 0.2) s / 10 steps; 0.02 s / 10
    assert use["cores"] == 0.42 and use["ms_per_step_total"] == 42.0
    assert cpu.per_step(11.5, 11.9, 5) == {}  # fewer than two samples inside: nothing to say


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_sampler_counts_this_process_more_while_it_burns_cpu_than_while_it_sleeps():
    cpu = ProcessCPU(interval=0.05)
    cpu.start()  # a child process samples /proc
    time.sleep(0.1)
    idle_start = time.time()
    time.sleep(0.5)
    busy_start = time.time()
    while time.time() - busy_start < 0.5:
        sum(range(10_000))
    busy_end = time.time()
    time.sleep(0.1)
    cpu.stop()
    idle = cpu.per_step(idle_start, busy_start, 1)["ms_per_step"].get("driver (this process)", 0.0)
    busy = cpu.per_step(busy_start, busy_end, 1)["ms_per_step"]["driver (this process)"]
    assert busy > idle
