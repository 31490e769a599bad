"""Where a job's wall time went, said once at its end: the start-up phases (what ran before the first step
was trained, and which of it ran side by side), then the steps and the evaluations.

The driver marks the phases it runs itself (`Phases.span`); the first step's `timeline` (its generate calls
and its training, wall clock, from the Train operator: operators/stages/train_metrics.py) says when the
engines produced their first rollouts and when step 1 was trained.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Mapping


def _clock(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s" if seconds >= 60 else f"{seconds:.1f}s"


class Phases:
    """Wall-clock spans of a job's start-up phases, from the job's start. A phase may be marked again (a
    restarted attempt): the first span is the start-up's."""

    def __init__(self, start: float | None = None):
        self.start = time.time() if start is None else start
        self.spans: dict[str, tuple[float, float]] = {}

    @contextmanager
    def span(self, name: str):
        begin = time.time()
        try:
            yield
        finally:
            self.add(name, begin, time.time())

    def add(self, name: str, begin: float, end: float) -> None:
        self.spans.setdefault(name, (begin, end))

    def from_first_step(self, timeline: Mapping | str) -> None:
        """The first trained step's timeline: the first rollouts' generate calls and the step's training."""
        entry = json.loads(timeline) if isinstance(timeline, str) else timeline
        calls = [(start, end) for _, start, end in entry.get("generate", [])]
        if calls:  # from the DAG's start (its engines starting) to the end of the first generate call
            first_start, first_end = min(calls)
            begin = self.spans["DAG built"][1] if "DAG built" in self.spans else first_start
            self.add("engines and first rollouts", begin, first_end)
        train_start, train_end = entry["train"]
        self.add("step 1 trained", train_start, train_end)

    def first_step_s(self) -> float | None:
        """Seconds from the job's start to the end of its first trained step (None: none trained)."""
        span = self.spans.get("step 1 trained")
        return None if span is None else span[1] - self.start

    def line(self) -> str:
        """One line: each phase's start and end from the job's start, in start order; phases that overlap
        another say so."""
        ordered = sorted(self.spans.items(), key=lambda item: item[1])
        parts = []
        for index, (name, (begin, end)) in enumerate(ordered):
            beside = [other for other, (b, e) in ordered[:index] if begin < e and b < end]  # started earlier
            text = f"{name} {_clock(begin - self.start)}-{_clock(end - self.start)}"
            parts.append(text + (f" (beside {', '.join(beside)})" if beside else ""))
        first = self.first_step_s()
        head = f"first step trained {_clock(first)} after the start" if first is not None else "no step trained"
        return f"streamrl: start-up: {head}: " + "; ".join(parts)


def wall_line(total_s: float, phases: Phases, overlap: Mapping[str, float] | None, evaluations: list[dict],
              steps: int) -> str:
    """Where the whole wall time went: start-up (to the end of the first step), the steps after it (the
    trainer's and the generators' busy shares), and the held-out evaluations (beside training, and after
    it while the job waited for them)."""
    first = phases.first_step_s()
    parts = [f"streamrl: wall time {_clock(total_s)}"]
    if first is not None:
        parts.append(f"start-up to the end of step 1 {_clock(first)} ({first / total_s:.0%})")
    if overlap:
        parts.append(f"{steps} step(s) over {_clock(overlap['window_s'])}: trainer busy "
                     f"{1 - overlap['trainer_idle_fraction']:.0%}, generators busy "
                     f"{1 - overlap['generator_idle_fraction']:.0%}")
    if evaluations:
        seconds = sum(float(row.get("eval/time_s", 0.0)) for row in evaluations)
        parts.append(f"{len(evaluations)} evaluation(s) {_clock(seconds)} in all")
    waited = phases.spans.get("waiting for evaluations")
    if waited is not None:
        parts.append(f"waited {_clock(waited[1] - waited[0])} for evaluations after the last step")
    return "; ".join(parts)
