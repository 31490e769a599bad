"""One line per train step on the terminal: where the job is and how long is left."""

from __future__ import annotations

import time
from typing import Callable


def summary_window(steps: int, edge: int = 10) -> int:
    """How many steps the run's summary averages at each end: 10, or half the run when it is shorter than 20
    steps, so that a short run's first and last windows do not overlap (a 16-step run compares steps 1-8 with
    9-16, not 1-10 with 7-16); 1 for a one-step run."""
    return max(1, min(edge, steps // 2))


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _number(value) -> float:
    """A metric as a float; a missing one (a skipped step's NaN loss comes back from Arrow as None) is NaN."""
    return float("nan") if value is None else float(value)


def _short(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 1e6 else f"{value:.3g}"


MIN_RATE_STEPS = 2  # steps measured after the first before a time-left estimate
MIN_RATE_S = 1.0  # seconds they must span


class Progress:
    def __init__(self, total_steps: int, echo: Callable[[str], None] = print, first_step: int = 0):
        """`first_step`: steps already done before this process (a resumed job)."""
        self.total_steps = total_steps
        self.echo = echo
        self.start = time.perf_counter()
        self.restart(first_step)

    def restart(self, first_step: int) -> None:
        """Count again from `first_step` (a restart from a checkpoint); elapsed time keeps running."""
        self.first_step_end: float | None = None
        self.done = first_step
        self.timed = 0  # steps finished by this process since the (re)start

    def update(self, row: dict) -> None:
        self.done = int(row["step"])
        self.timed += 1
        now = time.perf_counter()
        elapsed = now - self.start
        if self.first_step_end is None:  # start-up (actors, first weights) is not a step's cost
            self.first_step_end = now
        left = self.time_left(now)
        value = {key: _number(row.get(key)) for key in (
            "reward_mean", "success_rate", "policy_loss", "staleness_mean", "staleness_max", "tokens_per_s")}
        self.echo(
            f"step {int(row['step']):>4}/{self.total_steps}"
            f" | reward {_short(value['reward_mean'])} | success {value['success_rate']:.2f}"
            f" | loss {value['policy_loss']:+.4f} | staleness {value['staleness_mean']:.1f}/{value['staleness_max']:.0f}"
            f" | {value['tokens_per_s']:,.0f} tok/s | elapsed {_duration(elapsed)} | left {left}"
        )

    def time_left(self, now: float) -> str:
        """The steps left at the rate measured since the first step of this (re)start ended. Start-up is no
        step's cost, and steps arrive in bursts at first (a burst of ten in a few ms rates them at ~0 s each),
        so nothing is estimated until MIN_RATE_STEPS steps over MIN_RATE_S seconds were measured."""
        if self.done >= self.total_steps:
            return "0s"
        measured = now - self.first_step_end
        if self.timed - 1 < MIN_RATE_STEPS or measured < MIN_RATE_S:
            return "-"
        return _duration(measured / (self.timed - 1) * (self.total_steps - self.done))
