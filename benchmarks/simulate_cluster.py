"""SIMULATION: the real GRPO DAG at 32 and 128 (and 8) simulated GPUs, as an ablation table.

    python benchmarks/simulate_cluster.py                 # -> results/simulation.json, simulation.png
    python benchmarks/simulate_cluster.py --gpus 32 --runs a,d2 --steps 6
    python benchmarks/simulate_cluster.py --calibrate     # -> results/sim_calibration.json
    python benchmarks/sim_bound.py                        # each recorded speed-up against its bound (no re-run)

The DAG, scheduler, policy store, staleness gate, Ray Data backpressure, the rollout loop
(`operators/engines/rollout.py`) and the Train operator are the real ones (`pipelines.dag`); only the
engine (`benchmarks/sim_engine.py`, a continuous-batching cost model with the in-flight
engine's pause/resume) and the trainer's compute (`sim_trainer.py`) are modelled.
Accelerators are a Ray custom resource `sim_gpu`; one actor stands for a group of GPUs.
Time runs `time_scale` times faster than simulated time; every figure printed here is
simulated seconds (real seconds x time_scale) and is labelled as simulation.

The ablation, for each GPU count N (like verl's table):
  a   colocated sync, max_staleness 0: all N GPUs generate, then the same N train (each
      generation actor and the trainer hold half a `sim_gpu` per GPU: counted once), with the
      in-flight engine (continuous batching; the honest baseline).
  b   call-synchronous streaming (`rollout.in_flight: false`), max_staleness 2: the DAG before
      the in-flight engine; N/2 GPUs generate, N/2 train, one call at a time per actor.
  c0-c2  in-flight streaming, max_staleness 0, 1, 2; a weight update drains the requests
      in flight (`pause("wait")`).
  d1-d4  in-flight + partial rollout (`partial_rollout: true`), max_staleness 1, 2, 4; a weight
      update freezes them (`pause("keep")`), loads, and they go on with the new weights.
c and d at the same staleness share a layout (the split of the GPUs and the in-flight cap),
chosen by `plan_in_flight` (sim_layout.py: an analytic search over the cost model, see its docstring); b keeps
the split of the earlier sweeps (half the GPUs, the analytic balance being below half).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from benchmarks.sim_bound import add_bounds, print_table as print_bound_table
from benchmarks.sim_calibrate import calibrate
from benchmarks.sim_cost import CostModel
from benchmarks.sim_layout import (
    ABLATION, GENERATION_ACTORS, GPU_COST, GROUPS_PER_STEP, N_SAMPLES, TIME_SCALE, layout_for, scheduled_lengths,
    sync_estimate,
)
from benchmarks.sim_runs import check_invariants, init_sim_ray, run_layout, summarize

RESULTS = Path(__file__).parent / "results"


def zero_cost(cost: CostModel) -> CostModel:
    """The same DAG with no modelled work: what remains per step is Ray/DAG overhead."""
    return replace(cost, decode_step_s=0.0, decode_per_seq_s=0.0, weight_sync_s=0.0, train_seconds_per_token=0.0,
                   train_step_fixed_s=0.0)


def sweep(gpu_counts: list[int], steps: int, time_scales: dict[int, float], runs: list[str], overhead_runs: list[str],
          echo=print, gen_gpus: int | None = None, cap: int | None = None) -> dict:
    """For each GPU count, each run of the ablation; then `overhead_runs` again with zero modelled cost,
    to measure the DAG's own overhead per step."""
    import ray

    base = CostModel.from_dict(GPU_COST)
    records, overhead, plans = [], [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for gpus in gpu_counts:
            cost = replace(base, time_scale=time_scales.get(gpus, 10.0))
            layouts = {}
            for run in runs:
                layouts[run], plan = layout_for(run, gpus, cost, gen_gpus, cap)
                if plan is not None:
                    plans.setdefault(str(gpus), {})[f"max_staleness={layouts[run].max_staleness}"] = plan
            plans.setdefault(str(gpus), {})["sync_estimate_s"] = round(sync_estimate(gpus, cost), 1)
            init_sim_ray(gpus)
            try:
                for run, layout in layouts.items():
                    start = time.perf_counter()
                    result = run_layout(layout, cost, steps, Path(workdir))
                    check_invariants(result)
                    record = {**summarize(result, cost.time_scale), "time_scale": cost.time_scale}
                    records.append(record)
                    echo(f"SIMULATION {gpus:>4} GPUs {record['schedule']:<30} gen/train {layout.gen_gpus}/"
                         f"{layout.train_gpus}  {record['sim_seconds_per_step']:>7.1f} sim s/step (steady: "
                         f"{record['steady_sim_seconds_per_step'] or '-'})  "
                         f"stale<= {record['staleness_max']}  trainer idle {record['trainer_idle_fraction']:.2f}  "
                         f"spanning {record['groups_spanning_versions']}  ({time.perf_counter() - start:.0f} s real)")
                for run in overhead_runs:
                    if run not in layouts:
                        continue
                    result = run_layout(layouts[run], zero_cost(cost), steps, Path(workdir))
                    times = np.array(result["times"])
                    per_step = float((times[-1] - times[1]) / (len(times) - 2))
                    overhead.append({"run": run, "schedule": layouts[run].label, "gpus": gpus,
                                     "real_seconds_per_step": round(per_step, 3),
                                     "as_sim_seconds_per_step": round(per_step * cost.time_scale, 1)})
                    echo(f"overhead {gpus} GPUs {layouts[run].label}: {per_step:.3f} real s/step = "
                         f"{per_step * cost.time_scale:.1f} sim s/step")
            finally:
                ray.shutdown()
    for record in records:
        sync = next((r for r in records if r["gpus"] == record["gpus"] and r["run"] == "a"), None)
        if sync is not None:
            record["speedup_over_sync"] = round(record["sim_samples_per_s"] / sync["sim_samples_per_s"], 2)
    return {"cost_model": base.to_dict(), "time_scales": time_scales, "plans": plans, "records": records,
            "overhead": overhead}


def print_table(records: list[dict]) -> None:
    print("\nSIMULATION (cost-model engines and trainer inside the real DAG; simulated seconds)")
    print(f"{'GPUs':>5} {'schedule':<30}{'gen/train':>10}{'cap':>5}{'samples/s':>10}{'tokens/s':>10}{'speed-up':>9}"
          f"{'gen idle':>9}{'inst idle':>10}{'tr idle':>8}{'overlap':>8}{'spanning':>9}{'pause/upd':>10}  staleness")
    for r in records:
        pause = r["sim_pause_per_update_s"]["mean"] if r["sim_pause_per_update_s"] else float("nan")
        cap = r["max_seqs_in_flight_per_instance"] or "-"
        print(f"{r['gpus']:>5} {r['schedule']:<30}{r['gen_gpus']:>5}/{r['train_gpus']:<4}{cap:>5}"
              f"{r['sim_samples_per_s']:>10.1f}{r['sim_tokens_per_s']:>10.0f}{r.get('speedup_over_sync', float('nan')):>8.2f}x"
              f"{r['generator_idle_fraction']:>9.2f}{r['engine_instance_idle_fraction']:>10.2f}"
              f"{r['trainer_idle_fraction']:>8.2f}{r['overlap_efficiency']:>8.2f}"
              f"{r['groups_spanning_versions']:>5}/{r['groups']:<4}{pause:>9.1f}  {r['staleness_histogram']}")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({r["gpus"] for r in records})
    runs = list(dict.fromkeys(r["run"] for r in records))
    fig, axes = plt.subplots(1, len(gpus), figsize=(5.2 * len(gpus), 4.2), squeeze=False)
    colours = {"a": "#7f7f7f", "b": "#1f77b4", "c": "#ff7f0e", "d": "#2ca02c"}
    for ax, g in zip(axes[0], gpus):
        rows = [next((r for r in records if r["gpus"] == g and r["run"] == run), None) for run in runs]
        rows = [r for r in rows if r is not None and "speedup_over_sync" in r]
        bars = ax.bar(range(len(rows)), [r["speedup_over_sync"] for r in rows],
                      color=[colours[r["run"][0]] for r in rows])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(rows)), [f"{r['run']}\ns={r['max_staleness']}" for r in rows], fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        target = {32: 2.0, 128: 2.5}.get(g)
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label=f"target {target}x (s<=2)")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"{g} simulated GPUs", fontsize=9)
        ax.set_ylim(0, max([3.0] + [r["speedup_over_sync"] * 1.2 for r in rows]))
    axes[0][0].set_ylabel("samples/s over a: colocated sync")
    fig.suptitle("SIMULATION (cost models in the real DAG, not GPU measurements): a sync, b call-synchronous, "
                 "c in flight, d in flight + partial rollout; 7B policy, assumed H100 figures", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="32,128", help="simulated GPU counts (8 is optional)")
    parser.add_argument("--steps", type=int, default=7, help="train steps per run")
    parser.add_argument("--time-scale", type=float, default=None, help="simulated seconds per real second "
                        f"(default per GPU count: {TIME_SCALE})")
    parser.add_argument("--runs", default=",".join(ABLATION), help=f"runs of the ablation, of {','.join(ABLATION)}")
    parser.add_argument("--overhead-runs", default="a,d2", help="runs repeated at zero modelled cost (DAG overhead)")
    parser.add_argument("--gen-gpus", type=int, default=None, help="in-flight runs (c, d): generation GPUs instead of "
                        f"the plan's (a multiple of {GENERATION_ACTORS}, below the GPU count)")
    parser.add_argument("--cap", type=int, default=None, help="in-flight runs (c, d): sequences in flight per engine "
                        "instance instead of the plan's (at most the cost model's max_num_seqs)")
    parser.add_argument("--plan", action="store_true", help="print the layouts and the analytic plan; run nothing")
    parser.add_argument("--calibrate", action="store_true", help="measure per-token rates on this machine")
    parser.add_argument("--model-size", default="medium", help="calibration model (generate_throughput SIZES)")
    parser.add_argument("--name", default="simulation", help="result file stem")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.calibrate:
        record = calibrate(args.model_size, RESULTS / "sim_calibration.json")
        print(json.dumps(record, indent=2))
        return
    gpus = [int(g) for g in args.gpus.split(",")]
    scales = {g: args.time_scale or TIME_SCALE.get(g, 10.0) for g in gpus}
    runs = [run for run in args.runs.split(",") if run]
    unknown = set(runs) - set(ABLATION)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; use some of {','.join(ABLATION)}")
    if args.gen_gpus is not None and (args.gen_gpus <= 0 or args.gen_gpus % GENERATION_ACTORS
                                      or any(args.gen_gpus >= g for g in gpus)):
        parser.error(f"--gen-gpus {args.gen_gpus}: use a multiple of {GENERATION_ACTORS} below every --gpus count {gpus}")
    if args.cap is not None and not 0 < args.cap <= GPU_COST["max_num_seqs"]:
        parser.error(f"--cap {args.cap}: use 1 to max_num_seqs ({GPU_COST['max_num_seqs']})")
    if args.plan:
        for g in gpus:
            cost = replace(CostModel.from_dict(GPU_COST), time_scale=scales[g])
            print(f"{g} GPUs: sync estimate {sync_estimate(g, cost):.1f} sim s/step")
            for run in runs:
                layout, plan = layout_for(run, g, cost, args.gen_gpus, args.cap)
                print(f"  {layout.label:<30} {asdict(layout)} {plan or ''}")
        return
    started = time.perf_counter()
    result = sweep(gpus, args.steps, scales, runs, [r for r in args.overhead_runs.split(",") if r],
                   gen_gpus=args.gen_gpus, cap=args.cap)
    print_table(result["records"])
    calibration = RESULTS / "sim_calibration.json"
    record = {
        "label": "SIMULATION: cost-model engines and trainer inside the real streamrl DAG; not a measurement on GPUs",
        "command": "python benchmarks/simulate_cluster.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "real_seconds": round(time.perf_counter() - started, 1),
        "samples_per_step": GROUPS_PER_STEP * N_SAMPLES, "rows_per_step": GROUPS_PER_STEP, "samples_per_row": N_SAMPLES,
        "steps_per_run": args.steps,
        "cost_model_source": "assumed 7B / H100-class figures (see GPU_COST comments and benchmarks/studies/simulation.md)",
        "calibration_on_this_machine": json.loads(calibration.read_text()) if calibration.exists() else None,
        **result,
    }
    print("\nSIMULATION against its bound (benchmarks/sim_bound.py: the best any schedule could do, same staleness)")
    print_bound_table(add_bounds(record, scheduled_lengths(args.steps, CostModel.from_dict(GPU_COST))))
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    plot(result["records"], RESULTS / f"{args.name}.png")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
