"""The time-to-quality race's arithmetic and picture, apart from the runs (benchmarks/race.py).

A run's curve is its held-out accuracy at each evaluated policy version, against the train step and against
the wall time from the job's start to the end of that step (start-up included). A mode's curve is its seeds'
median, with their spread (min to max) drawn around it. The headline figures are the wall time at which a
run first reaches a threshold (the step-0 accuracy + 0.15, and 0.85), a mode's figure the median over its
seeds; a seed that never reaches it counts as never, and a mode whose median seed never reaches it says so.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path


OPTIONAL = ("answered_rate", "accuracy_among_answered")  # a point's other scores, when the job has them


def first_reach(points: list[dict], threshold: float, key: str = "wall_s") -> float | None:
    """`key` of the first point (in step order) whose accuracy is at least `threshold`; None: never."""
    for point in sorted(points, key=lambda p: p["step"]):
        if point["accuracy"] >= threshold - 1e-12:
            return float(point[key])
    return None


def median_reach(values: list[float | None]) -> float | None:
    """The median over seeds, a seed that never reached counting as infinitely late; None when the median
    seed never reached."""
    if not values:
        return None
    ranked = sorted(values, key=lambda v: float("inf") if v is None else v)
    if len(ranked) % 2:
        return ranked[len(ranked) // 2]
    low, high = ranked[len(ranked) // 2 - 1], ranked[len(ranked) // 2]
    return None if low is None or high is None else (low + high) / 2


def mode_curve(runs: list[dict]) -> list[dict]:
    """Per evaluated step: the seeds' median accuracy, its min and max, and the median wall time."""
    steps = sorted({p["step"] for run in runs for p in run["points"]})
    curve = []
    for step in steps:
        at = [p for run in runs for p in run["points"] if p["step"] == step]
        accuracy = [p["accuracy"] for p in at]
        point = {"step": step, "seeds": len(at), "accuracy": statistics.median(accuracy),
                 "accuracy_min": min(accuracy), "accuracy_max": max(accuracy),
                 "wall_s": statistics.median(p["wall_s"] for p in at)}
        for key in OPTIONAL:  # with the answer_format reward; NaN (no answer stated) counts as no figure
            values = [p[key] for p in at if key in p and math.isfinite(p[key])]
            if values:
                point[key] = statistics.median(values)
        curve.append(point)
    return curve


def headline(runs: list[dict], base: float, target: float, rise: float) -> dict:
    """Time to (base + rise) and to `target` for each seed and their medians (None: never reached)."""
    up = [first_reach(run["points"], base + rise) for run in runs]
    to_target = [first_reach(run["points"], target) for run in runs]
    steps_up = [first_reach(run["points"], base + rise, "step") for run in runs]
    steps_target = [first_reach(run["points"], target, "step") for run in runs]
    return {"rise_threshold": round(base + rise, 4), "target": target,
            "wall_s_to_rise": up, "wall_s_to_target": to_target, "steps_to_rise": steps_up,
            "steps_to_target": steps_target, "median_wall_s_to_rise": median_reach(up),
            "median_wall_s_to_target": median_reach(to_target), "median_steps_to_rise": median_reach(steps_up),
            "median_steps_to_target": median_reach(steps_target)}


def say(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "never"
    return f"{value / 60:.1f} min" if unit == "s" else f"step {value:g}"


def plot(modes: dict[str, list[dict]], path: Path, title: str, base: float, target: float, rise: float) -> None:
    """One PNG: accuracy against wall time (left) and against steps (right), a median line and a min-max
    band per mode, the two thresholds dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for (mode, curve), color in zip(modes.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        for ax, x, scale in ((axes[0], "wall_s", 60.0), (axes[1], "step", 1.0)):
            xs = [p[x] / scale for p in curve]
            ax.plot(xs, [p["accuracy"] for p in curve], marker="o", color=color, label=mode)
            ax.fill_between(xs, [p["accuracy_min"] for p in curve], [p["accuracy_max"] for p in curve],
                            color=color, alpha=0.18, linewidth=0)
    for ax, label in ((axes[0], "wall time from the job's start (min)"), (axes[1], "train step (policy version)")):
        for level, name in ((base + rise, f"step 0 + {rise:g}"), (target, f"{target:g}")):
            ax.axhline(level, color="grey", linestyle=":", linewidth=1)
            ax.text(ax.get_xlim()[0], level, f" {name}", va="bottom", fontsize=7, color="grey")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (median of seeds; band: min-max)")
    axes[0].set_ylim(0, 1.02)
    axes[1].legend(title="max_staleness", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
