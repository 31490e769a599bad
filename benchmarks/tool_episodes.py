"""Episodes/s on the tiny tool task (configs/tiny_tools.yaml), with and without partial rollout.

    python benchmarks/tool_episodes.py [--steps 30] [--rounds 2] [--latency none,slow]

Multi-turn episodes on vLLM's in-flight engine; each job in its own process (fresh Ray). Two modes:

  drain    rollout.partial_rollout: false: a new policy version waits for every episode in flight to
           end (all its turns and tool calls), so each episode comes from one version
  partial  rollout.partial_rollout: true: the update pauses the requests in flight, loads and resumes;
           episodes go on with the new weights (their tokens record their versions)

and two tool latencies: "none" (the calculator answers in microseconds) and "slow" (every call sleeps
first, lognormal with a median of 0.2 s, capped at 2 s, drawn from the expression so both modes wait
the same: a tool that calls a service or runs code; benchmarks/bench_tools.py). Modes alternate
(A B A B) within each latency, so drift on a shared machine hits both; the figure per mode is the
median of its rounds. Episodes/s is over the steady window (first generate start -> last train end,
pipelines/tracking/timeline.py), start-up excluded. Writes benchmarks/results/tool_episodes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CONFIG = ROOT / "configs" / "tiny_tools.yaml"
MODES = {"drain": False, "partial": True}
LATENCIES = {
    "none": ["rollout.environment.options.tools=[calculator]"],
    # 16 sandbox processes: enough that calls wait on the tool, not on a free sandbox
    "slow": ["rollout.environment.options.tools=[benchmarks.bench_tools:slow_calculator]",
             "rollout.environment.options.sandboxes=16"],
}


def run_one(mode: str, latency: str, steps: int, output_dir: str) -> dict:
    """In a child process: one job; its figures."""
    from pipelines.config.load import load_config
    from pipelines.job import run_job
    from pipelines.runtime.session import init_ray
    from pipelines.tracking.timeline import overlap_report
    from pipelines.runtime.memory import local_object_store_mb

    overrides = [f"output_dir={output_dir}", f"train.steps={steps}", "eval=null", "tracking.enabled=false",
                 "train.checkpoint_every=0", f"rollout.partial_rollout={str(MODES[mode]).lower()}",
                 *LATENCIES[latency]]
    cfg = load_config(CONFIG, overrides)
    init_ray(num_cpus=cfg.ray.num_cpus, object_store_memory_mb=local_object_store_mb(cfg, None))
    started = time.time()
    import ray

    try:
        result = run_job(cfg)
    finally:
        ray.shutdown()
    metrics = result.metrics
    report = overlap_report(list(metrics["timeline"]))
    episodes = int(metrics["num_groups"].sum()) * cfg.rollout.n
    return {
        "mode": mode, "latency": latency, "steps": len(metrics), "episodes": episodes,
        "window_s": report["window_s"], "wall_s": time.time() - started,
        "episodes_per_s": episodes / report["window_s"],
        "tool_calls": int(metrics["tool_calls"].sum()), "tool_errors": int(metrics["tool_errors"].sum()),
        "turns_mean": float(metrics["turns_mean"].mean()),
        "success_first10": float(metrics["success_rate"].head(10).mean()),
        "success_last10": float(metrics["success_rate"].tail(10).mean()),
        "staleness_max": int(metrics["staleness_max"].max()),
        "trainer_idle_fraction": report["trainer_idle_fraction"],
        "generator_idle_fraction": report["generator_idle_fraction"],
        "weight_updates": int(len(result.weight_updates)),
        "weight_pause_s_median": float(result.weight_updates["pause_s"].median()) if len(result.weight_updates) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="runs per mode (alternating A B A B)")
    parser.add_argument("--latency", default="none,slow", help=f"tool latencies: any of {', '.join(LATENCIES)}")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child: MODE LATENCY
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.one:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="srl-tools-") as folder:
            Path(args.out).write_text(json.dumps(run_one(*args.one, args.steps, folder)))
        return
    latencies = [name.strip() for name in args.latency.split(",") if name.strip()]
    unknown = [name for name in latencies if name not in LATENCIES]
    if unknown:
        parser.error(f"unknown latencies {unknown}; choose from {list(LATENCIES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for latency in latencies:
        for index in range(args.rounds):
            for mode in MODES:
                out = RESULTS / f".tool_episodes-{mode}-{latency}.json"
                print(f"=== {latency} tool latency, {mode}, round {index + 1}/{args.rounds}", flush=True)
                env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the slow tool, importable in the sandboxes
                subprocess.run([sys.executable, __file__, "--one", mode, latency, "--out", str(out),
                                "--steps", str(args.steps)], check=True, cwd=ROOT, env=env)
                run = json.loads(out.read_text())
                out.unlink()
                runs.append(run)
                print(f"=== {latency}/{mode}: {run['episodes_per_s']:.1f} episodes/s over {run['window_s']:.1f} s "
                      f"({run['episodes']} episodes, {run['tool_calls']} tool calls, success "
                      f"{run['success_first10']:.2f} -> {run['success_last10']:.2f})", flush=True)
    summary = {}
    for latency in latencies:
        rates = {mode: statistics.median(r["episodes_per_s"] for r in runs if r["mode"] == mode and r["latency"] == latency)
                 for mode in MODES}
        summary[latency] = {**{f"{mode}_episodes_per_s": rate for mode, rate in rates.items()},
                            "partial/drain": rates["partial"] / rates["drain"]}
    print("\nlatency  drain ep/s  partial ep/s  partial/drain")
    for latency, row in summary.items():
        print(f"{latency:<8} {row['drain_episodes_per_s']:>10.1f} {row['partial_episodes_per_s']:>13.1f} "
              f"{row['partial/drain']:>14.2f}x")
    record = {"command": " ".join(["python", "benchmarks/tool_episodes.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "config": str(CONFIG.relative_to(ROOT)), "steps": args.steps, "rounds": args.rounds,
              "summary": summary, "runs": runs}
    path = RESULTS / "tool_episodes.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
