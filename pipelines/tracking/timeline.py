"""Where a job's time went: busy intervals of the generators and the trainer, overlap efficiency.

Every metrics row of a job carries a `timeline` entry (JSON text): the step's train interval and the
(generator id, start, end) interval of each generate call that fed it (wall clock; a
generate interval includes pulling new weights and excludes waiting at the staleness
gate). From those:

- `window_s`: first generate start -> last train end (start-up excluded).
- `generator_busy_s`: busy time per generator (mean over generators), `trainer_busy_s`.
- `ideal_s`: the shortest wall any schedule could reach with these busy times when the
  stages overlap perfectly: the trainer cannot start before the first step is generated,
  and the last step still has to be trained after generation ends, so
  ideal = max(first_step_generate + trainer_busy, generator_busy + last_train).
- `overlap_efficiency` = ideal_s / window_s (1.0 = perfect overlap).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Iterable, Mapping


def _merged_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of intervals (overlapping calls of one generator count once)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def overlap_report(timelines: list[Mapping | str]) -> dict[str, float]:
    """Busy times, idle fractions and overlap efficiency from the per-step `timeline` entries
    (dicts, or the JSON text a job's metrics rows carry), in step order."""
    timelines = [json.loads(t) if isinstance(t, str) else t for t in timelines]
    if not timelines:
        raise ValueError("no steps: nothing to analyse")
    train = [tuple(t["train"]) for t in timelines]
    by_generator: dict[str, list[tuple[float, float]]] = defaultdict(list)
    first_step: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for index, entry in enumerate(timelines):
        for generator, start, end in entry["generate"]:
            by_generator[generator].append((start, end))
            if index == 0:
                first_step[generator].append((start, end))
    if not by_generator:
        raise ValueError("the timelines hold no generate intervals")
    generators = len(by_generator)
    generator_busy = sum(_merged_length(v) for v in by_generator.values()) / generators
    first_generate = max(_merged_length(v) for v in first_step.values()) if first_step else 0.0
    trainer_busy = sum(end - start for start, end in train)
    window_start = min(start for v in by_generator.values() for start, _ in v)
    window_end = max(end for _, end in train)
    window = window_end - window_start
    last_train = train[-1][1] - train[-1][0]
    ideal = max(first_generate + trainer_busy, generator_busy + last_train)
    return {
        "window_s": window,
        "generators": generators,
        "generator_busy_s": generator_busy,
        "trainer_busy_s": trainer_busy,
        "first_step_generate_s": first_generate,
        "last_train_s": last_train,
        "ideal_s": ideal,
        "overlap_efficiency": ideal / window if window > 0 else float("nan"),
        "generator_idle_fraction": max(0.0, 1.0 - generator_busy / window) if window > 0 else float("nan"),
        "trainer_idle_fraction": max(0.0, 1.0 - trainer_busy / window) if window > 0 else float("nan"),
    }
