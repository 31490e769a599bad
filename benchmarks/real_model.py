"""The real model on a real task: does it learn, and how far apart are the engine's and the trainer's
log-probs at the start?

    python benchmarks/real_model.py learn configs/smollm2_basic_arithmetic.yaml
    python benchmarks/real_model.py mismatch configs/smollm2_basic_arithmetic.yaml
    python benchmarks/real_model.py race configs/smollm2_basic_arithmetic.yaml [--modes 0,default,2 --seeds 3 --every 4]
    python benchmarks/real_model.py learn configs/smollm2_basic_arithmetic.yaml --name smollm2_basic_arithmetic_bf16 \
        --set output_dir=runs/smollm2_bf16 --set train.dtype=bf16 --set train.zero_stage=1 --set rollout.vllm.dtype=bfloat16

`learn` runs the config as `streamrl run` does (in this process), then draws the held-out accuracy
(eval/greedy_success_rate and eval/success_rate, greedy and sampled, per policy version) and the training reward per
step into benchmarks/results/<config>_learning.png, logs that picture to the run in MLflow
(learning_curve.png), and writes benchmarks/results/<config>_learning.json: wall time, the eval rows,
the rise from step 0 to the best and to the last evaluation.

`mismatch` runs one step of the same config (no evaluation, no checkpoints) once per training dtype
(fp32, and bf16 with ZeRO-1) at max_staleness 0, and records what the trainer saw at that first update:
mismatch_k3 (E[rho - 1 - log rho] over response tokens, rho = pi_trainer / pi_vLLM), rho at p50 / p99 /
max / min, and the PPO ratio's mean and range, into benchmarks/results/<config>_mismatch.json.

`race` (benchmarks/race.py) is time to quality: the config in several modes (max_staleness 0, the config's,
2) over several seeds, one run after another, held-out accuracy scored on each run's checkpoints after the
run; the wall time to step 0 + 0.15 and to 0.85 per mode, into benchmarks/results/<config>_race.json / .png.

Figures move with machine load: run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import race as race_mode
from benchmarks.race import machine

RESULTS = Path(__file__).resolve().parent / "results"
MISMATCH_METRICS = ("mismatch_k3", "mismatch_k1", "is_ratio_p50", "is_ratio_p99", "is_ratio_max", "is_ratio_min",
                    "is_ratio_mean", "ratio_mean", "ratio_max", "ratio_min", "is_tokens", "response_length_mean")


def _job(config: str, overrides: list[str], echo=print):
    from pipelines.config.load import load_config
    from pipelines.job import run_job

    cfg = load_config(config, overrides)
    started = time.perf_counter()
    result = run_job(cfg, echo=echo)
    return cfg, result, time.perf_counter() - started


def learn(config: str, overrides: list[str], name: str | None = None) -> dict:
    cfg, result, wall = _job(config, overrides)
    evals = result.eval_metrics.sort_values("step").reset_index(drop=True)  # step v: policy version v
    name = name or Path(config).stem
    picture = RESULTS / f"{name}_learning.png"
    _plot(result.metrics, evals, picture, title=f"{name}: {cfg.model.path} on {cfg.data.path}")
    key = "eval/greedy_success_rate" if "eval/greedy_success_rate" in evals.columns else "eval/success_rate"
    first, last, best = float(evals[key].iloc[0]), float(evals[key].iloc[-1]), float(evals[key].max())
    record = {
        "command": f"python benchmarks/real_model.py learn {config}" + (f" --name {name}" if name != Path(config).stem
                                                                         else "")
                   + "".join(f" --set {o}" for o in overrides),
        **machine(), "run_id": result.run_id, "wall_s": round(wall, 1), "steps": int(len(result.metrics)),
        "accuracy_metric": key, "accuracy_step0": first, "accuracy_last": last, "accuracy_best": best,
        "rise_last": round(last - first, 4), "rise_best": round(best - first, 4),
        "eval": evals.to_dict("records"),
        "train_reward_mean": result.metrics["reward_mean"].round(4).tolist() if "reward_mean" in result.metrics else [],
        "picture": str(picture.relative_to(RESULTS.parent.parent)),
    }
    if result.run_id and cfg.tracking.enabled:
        import mlflow

        mlflow.set_tracking_uri(cfg.tracking_uri())
        mlflow.MlflowClient().log_artifact(result.run_id, str(picture))
    out = RESULTS / f"{name}_learning.json"
    out.write_text(json.dumps(record, indent=1, default=float) + "\n")
    print(f"{key}: step 0 {first:.3f} -> last {last:.3f} (best {best:.3f}) in {len(result.metrics)} steps, "
          f"{wall / 60:.1f} min; {picture}, {out}")
    return record


def _plot(metrics, evals, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for column, label in (("eval/greedy_success_rate", "held-out accuracy (greedy)"),
                          ("eval/success_rate", "held-out accuracy (sampled)")):
        if column in evals.columns:
            ax.plot(evals["step"], evals[column], marker="o", label=label)
    if "success_rate" in metrics.columns:
        steps = metrics["step"] if "step" in metrics.columns else range(len(metrics))
        ax.plot(steps, metrics["success_rate"].rolling(5, min_periods=1).mean(), alpha=0.6,
                label="training success (5-step mean)")
    ax.set_xlabel("train step (policy version)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mismatch(config: str, overrides: list[str]) -> dict:
    runs = {}
    for dtype, extra in (("fp32", ["train.dtype=fp32"]), ("bf16", ["train.dtype=bf16", "train.zero_stage=1"])):
        settings = ["train.steps=1", "train.max_staleness=0", "train.checkpoint_every=0", "tracking.log_model=false",
                    "eval=null", *extra, *overrides]
        _, result, wall = _job(config, settings)
        row = result.metrics.iloc[0]
        runs[dtype] = {name: float(row[name]) for name in MISMATCH_METRICS if name in row.index}
        runs[dtype]["wall_s"] = round(wall, 1)
        print(f"{dtype}: " + ", ".join(f"{k} {v:.6g}" for k, v in runs[dtype].items()))
    record = {"command": f"python benchmarks/real_model.py mismatch {config}" + "".join(f" --set {o}" for o in overrides),
              **machine(), "step": 0, "runs": runs}
    out = RESULTS / f"{Path(config).stem}_mismatch.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(out)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["learn", "mismatch", "race"])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE, as streamrl run")
    parser.add_argument("--name", help="learn: the results' file stem (default: the config's), for a variant such as "
                                       "another dtype")
    race_mode.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.what == "race":
        race_mode.from_arguments(args)
    elif args.what == "learn":
        learn(args.config, args.overrides, args.name)
    else:
        mismatch(args.config, args.overrides)


if __name__ == "__main__":  # vLLM starts its engine with spawn
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
