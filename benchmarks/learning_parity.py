"""Does bounded staleness cost learning, and does the off-policy correction help? The tiny task per
(policy loss, max_staleness), several seeds.

    flock /tmp/streamrl-bench.lock python benchmarks/learning_parity.py \
        [--losses ppo_clip,decoupled_tis] [--seeds 0,1,2,3,4] [--staleness 0,4,8] [--steps 60]

Losses: ppo_clip (naive PPO: clip centred on the behaviour policy), decoupled (decoupled PPO),
decoupled_tis (decoupled PPO + token TIS, cap 2), ppo_clip_tis (naive PPO + token TIS, cap 2).
Runs configs/tiny_grpo.yaml once per (loss, staleness, seed) (the seed moves the prompt order and
the samplers; the model is the same), prints the success rate of the last 10 steps of each run,
compares each setting with the same loss at the first staleness against the run-to-run noise (the
spread of one setting across seeds), and summarises the importance-ratio statistics of every
setting (observed staleness, is_ratio = pi_prox / pi_behave, truncated fraction, clip fraction,
mismatch KL). Writes benchmarks/results/<name>.json (default learning_parity_off_policy) and a PNG of every curve (per-step success
rate, 5-step moving average).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

LOSSES = {
    "ppo_clip": [],
    "decoupled": ["algorithm.policy_loss=decoupled_ppo"],
    "decoupled_tis": ["algorithm.policy_loss=decoupled_ppo", "algorithm.tis=token", "algorithm.tis_cap=2.0"],
    "ppo_clip_tis": ["algorithm.tis=token", "algorithm.tis_cap=2.0"],
}
# Per-step metrics summarised per setting: (column, how steps and seeds are reduced).
RATIO_METRICS = [
    ("staleness_mean", "mean"), ("staleness_max", "max"), ("is_ratio_mean", "mean"), ("is_ratio_p99", "mean"),
    ("is_ratio_max", "max"), ("is_ratio_min", "min"), ("tis_fraction", "mean"), ("clip_fraction", "mean"),
    ("mismatch_k3", "mean"), ("approx_kl", "mean"), ("ratio_behavior_max", "max"),
]


def moving_average(values: list[float], window: int = 5) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i - window + 1): i + 1].mean() for i in range(len(values))])


def reduce(values: list[float], how: str) -> float:
    values = [v for v in values if not math.isnan(v)]  # NaN: the metric was absent in that step
    return float(getattr(np, how)(values)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", default="ppo_clip,decoupled_tis")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--staleness", default="0,4")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--name", default="learning_parity_off_policy")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from pipelines.config.load import load_config
    from pipelines.job import run_job
    from pipelines.runtime.session import init_ray

    losses = args.losses.split(",")
    unknown = [loss for loss in losses if loss not in LOSSES]
    if unknown:
        parser.error(f"unknown --losses {unknown}; use some of {list(LOSSES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    levels = [int(s) for s in args.staleness.split(",")]
    settings = [(loss, level) for loss in losses for level in levels]
    init_ray(num_cpus=2)  # one cluster for every run: start-up is not what this measures
    curves: dict[str, dict[int, list[float]]] = {}
    ratios: dict[str, dict[str, list[list[float]]]] = {}
    started = time.time()
    for loss, level in settings:
        key = f"{loss}/staleness{level}"
        curves[key], ratios[key] = {}, {name: [] for name, _ in RATIO_METRICS}
        for seed in seeds:
            cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [
                *LOSSES[loss], f"train.max_staleness={level}", f"train.seed={seed}", f"data.seed={seed}",
                f"train.steps={args.steps}", "eval=null", "train.checkpoint_every=0",
                "tracking.experiment=learning-parity", f"tracking.run_name={loss}-staleness{level}-seed{seed}",
                "output_dir=runs/parity",
            ])
            metrics = run_job(cfg, echo=lambda line: None).metrics
            curves[key][seed] = metrics["success_rate"].tolist()
            for name, _ in RATIO_METRICS:
                ratios[key][name].append(metrics[name].tolist() if name in metrics else [])
            print(f"{key} seed {seed}: success first 10 {np.mean(curves[key][seed][:10]):.3f} -> last 10 "
                  f"{np.mean(curves[key][seed][-10:]):.3f}, staleness mean {metrics['staleness_mean'].mean():.2f} "
                  f"({time.time() - started:.0f}s)", flush=True)

    last10 = {key: {seed: float(np.mean(c[-10:])) for seed, c in per_seed.items()} for key, per_seed in curves.items()}
    means = {key: float(np.mean(list(v.values()))) for key, v in last10.items()}
    spreads = {key: float(max(v.values()) - min(v.values())) for key, v in last10.items()}
    noise = max(spreads.values())  # run-to-run noise: the largest spread of one setting across seeds
    summary = {key: {name: reduce([v for run in ratios[key][name] for v in run], how) for name, how in RATIO_METRICS}
               for key in curves}
    print(f"\nlast-10-step success rate, mean over seeds {seeds} (spread = max - min across seeds):")
    for key in curves:
        print(f"  {key:32s} {means[key]:.3f}  spread {spreads[key]:.3f}  "
              f"(per seed: {', '.join(f'{x:.3f}' for x in last10[key].values())})")
    print(f"run-to-run noise (largest spread across seeds of one setting): {noise:.3f}")
    gaps = {}
    for loss in losses:
        base = f"{loss}/staleness{levels[0]}"
        for level in levels[1:]:
            key = f"{loss}/staleness{level}"
            gaps[key] = means[key] - means[base]
            paired = [last10[key][seed] - last10[base][seed] for seed in seeds]
            print(f"  {key} - {base}: {gaps[key]:+.3f} -> {'within' if abs(gaps[key]) <= noise else 'OUTSIDE'} noise; "
                  f"paired by seed: {', '.join(f'{x:+.3f}' for x in paired)}")
    print("\nratio statistics per setting (means over steps and seeds; max/min over them):")
    print("  " + " ".join(f"{name:>18s}" for name, _ in RATIO_METRICS))
    for key in curves:
        print(f"  {key}\n  " + " ".join(f"{summary[key][name]:18.4g}" for name, _ in RATIO_METRICS))

    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "seeds": seeds,
              "steps": args.steps, "losses": {loss: LOSSES[loss] for loss in losses},
              "curves": {key: {str(k): v for k, v in c.items()} for key, c in curves.items()},
              "last10": {key: {str(k): v for k, v in c.items()} for key, c in last10.items()},
              "last10_mean": means, "last10_spread": spreads, "noise": noise, "gap_vs_first_staleness": gaps,
              "ratio_statistics": summary, "notes": ""}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(losses), figsize=(6 * len(losses), 4.5), sharey=True, squeeze=False)
    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    for ax, loss in zip(axes[0], losses):
        for color, level in zip(colors, levels):
            key = f"{loss}/staleness{level}"
            for curve in curves[key].values():
                ax.plot(moving_average(curve), color=color, alpha=0.3, linewidth=1)
            mean_curve = np.mean([moving_average(c) for c in curves[key].values()], axis=0)
            ax.plot(mean_curve, color=color, linewidth=2.5, label=f"max_staleness {level} (mean of {len(seeds)} seeds)")
        ax.set_title(f"{loss}")
        ax.set_xlabel("train step")
        ax.legend()
    axes[0][0].set_ylabel("success rate (5-step moving average)")
    fig.suptitle("tiny GRPO task: learning under staleness per policy loss (thin: single seeds)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)
    print(f"wrote benchmarks/results/{args.name}.json and .png")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
