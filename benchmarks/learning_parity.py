"""Does bounded staleness cost learning? The tiny task at max_staleness 2 vs 0, several seeds.

    python benchmarks/learning_parity.py [--seeds 0,1,2] [--staleness 0,2] [--steps 60]

Runs configs/tiny_grpo.yaml once per (staleness, seed) (the seed moves the prompt order and
the samplers; the model is the same), prints the success rate of the last 10 steps of each
run, and compares the gap between staleness settings with the run-to-run noise: the spread
of the same setting across seeds. Writes benchmarks/results/learning_parity.json and a PNG
of every curve (per-step success rate, 5-step moving average).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)] if str(ROOT) not in sys.path else []
RESULTS = HERE / "results"


def moving_average(values: list[float], window: int = 5) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i - window + 1): i + 1].mean() for i in range(len(values))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--staleness", default="0,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--name", default="learning_parity")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from pipelines.config import load_config
    from pipelines.grpo import init_ray, run_job

    seeds = [int(s) for s in args.seeds.split(",")]
    settings = [int(s) for s in args.staleness.split(",")]
    init_ray(num_cpus=2)  # one cluster for every run: start-up is not what this measures
    curves: dict[int, dict[int, list[float]]] = {s: {} for s in settings}
    started = time.time()
    for staleness in settings:
        for seed in seeds:
            cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [
                f"train.max_staleness={staleness}", f"train.seed={seed}", f"data.seed={seed}",
                f"train.steps={args.steps}", "tracking.experiment=learning-parity",
                f"tracking.run_name=staleness{staleness}-seed{seed}", "output_dir=runs/parity",
            ])
            result = run_job(cfg, echo=lambda line: None)
            curves[staleness][seed] = result.metrics["success_rate"].tolist()
            print(f"staleness {staleness} seed {seed}: success first 10 {np.mean(curves[staleness][seed][:10]):.3f} "
                  f"-> last 10 {np.mean(curves[staleness][seed][-10:]):.3f} ({time.time() - started:.0f}s)", flush=True)

    last10 = {s: {seed: float(np.mean(c[-10:])) for seed, c in curves[s].items()} for s in settings}
    means = {s: float(np.mean(list(v.values()))) for s, v in last10.items()}
    # Run-to-run noise: the largest spread (max - min over seeds) of one setting's last-10 success.
    noise = max(max(v.values()) - min(v.values()) for v in last10.values())
    base = settings[0]
    gaps = {s: means[s] - means[base] for s in settings[1:]}
    print(f"\nlast-10-step success rate, mean over seeds {seeds}:")
    for s in settings:
        print(f"  max_staleness {s}: {means[s]:.3f}  (per seed: {', '.join(f'{x:.3f}' for x in last10[s].values())})")
    print(f"run-to-run noise (largest spread across seeds of one setting): {noise:.3f}")
    for s, gap in gaps.items():
        print(f"  staleness {s} - staleness {base}: {gap:+.3f} -> {'within' if abs(gap) <= noise else 'OUTSIDE'} noise")
        paired = [last10[s][seed] - last10[base][seed] for seed in seeds]
        print(f"  paired by seed (same prompt order and sampler seeds): {', '.join(f'{x:+.3f}' for x in paired)}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "seeds": seeds, "steps": args.steps,
              "curves": {str(s): {str(k): v for k, v in c.items()} for s, c in curves.items()},
              "last10": {str(s): {str(k): v for k, v in c.items()} for s, c in last10.items()},
              "last10_mean": {str(s): v for s, v in means.items()}, "noise": noise,
              "gap": {str(s): v for s, v in gaps.items()}}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(record, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    for color, s in zip(colors, settings):
        for seed, curve in curves[s].items():
            ax.plot(moving_average(curve), color=color, alpha=0.35, linewidth=1)
        mean_curve = np.mean([moving_average(c) for c in curves[s].values()], axis=0)
        ax.plot(mean_curve, color=color, linewidth=2.5, label=f"max_staleness {s} (mean of {len(seeds)} seeds)")
    ax.set_xlabel("train step")
    ax.set_ylabel("success rate (5-step moving average)")
    ax.set_title("tiny GRPO task: learning at max_staleness 2 vs 0 (thin: single seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)
    print(f"wrote benchmarks/results/{args.name}.json and .png")


if __name__ == "__main__":
    main()
