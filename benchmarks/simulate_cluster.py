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
chosen by `plan_in_flight` (an analytic search over the cost model, see its docstring); b keeps
the split of the earlier sweeps (half the GPUs, the analytic balance being below half).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The simulated engine is benchmark code (benchmarks/sim_engine.py), imported by name in the generate actors:
# the local cluster's workers inherit this environment, so they find it from any working directory.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import sim_trainer

from benchmarks.sim_bound import add_bounds, print_table as print_bound_table, steady_seconds_per_step
from benchmarks.sim_engine import ENGINE as SIM_ENGINE, CostModel, SimEngine

RESULTS = Path(__file__).parent / "results"

# The modelled cluster: a 7B dense policy (Qwen2.5-7B-like: 7.6e9 parameters, bf16, GQA)
# on H100-class GPUs, one GPU per vLLM instance (TP=1). These are ASSUMPTIONS from public
# hardware figures, not measurements; benchmarks/README.md gives the arithmetic. Unchanged
# since the first sweep (2026-11-30), so the ablation's gains come from the schedule.
GPU_COST = {
    "decode_step_s": 0.008,  # TPOT of an 8B model on one H100 at batch 1: ~7-8 ms (weights 15 GB / 3.35 TB/s = 4.5 ms + overhead)
    "decode_per_seq_s": 1.0e-4,  # + ~0.1 ms per active sequence (KV reads at ~1-2k context, sampling): ~34 ms at 256
    "max_num_seqs": 256,
    "weight_sync_s": 3.0,  # stall of generation per new policy version (broadcast 15 GB + reload; colocated: reshard)
    "train_seconds_per_token": 1.54e-4,  # 8 x 7.6e9 FLOP/token (fwd+bwd 6N, proximal log-prob forward 2N) / (989e12 x 0.40 MFU)
    "train_step_fixed_s": 2.0,  # optimizer step and gradient all-reduce tail per step
    "prompt_tokens": 256,
    "gpus_per_instance": 1,
    "token_unit": 64,
    "length": {"median": 1000, "sigma": 1.0, "cap": 16384},  # reasoning-RL-like: mean ~1650, p99 ~10k, 0.26% capped
}
# 8192 samples per step, 128 prompts x 64 responses. Group size is not in the cost model (lengths are
# drawn independently per response); it sets how finely the rollout loop can refill the slots a finished
# response frees (a group starts when n slots are free), against the DAG's overhead, which grows with rows.
GROUPS_PER_STEP = 128  # rows per step
N_SAMPLES = 64  # responses per row
GENERATION_ACTORS = 4  # actors holding generation GPUs (memory and CPU of this machine: ~150-200 MB each)
CALL_SYNC_ACTORS = 8  # b: more actors than calls per step, so calls of 2 steps run at once on different GPUs
CALL_SYNC_CALLS_PER_STEP = 4
GROUPS_PER_IN_FLIGHT_CALL = 4
# Simulated seconds per real second, per GPU count: a step lasts ~10-30 s real, so the DAG's own per-step
# overhead (1-3 s real on the shared 2-core machine, more with more rows per step) stays small beside it.
TIME_SCALE = {8: 40.0, 32: 12.0, 128: 6.0}
ABLATION = ("a", "b", "c0", "c1", "c2", "d1", "d2", "d4")


@dataclass(frozen=True)
class Layout:
    """How N simulated GPUs are used by one schedule of the ablation."""

    run: str  # a, b, c0..c2, d1..d4
    gpus: int
    max_staleness: int
    colocated: bool
    in_flight: bool
    partial_rollout: bool
    gen_gpus: int
    train_gpus: int
    actors: int  # Generate actors; each stands for gen_gpus / actors engine instances
    groups_per_call: int
    calls_in_flight: int = 1  # Generate calls per actor at once (in flight), 1 when call-synchronous
    cap_per_instance: int = 0  # in flight: sequences in flight per engine instance (0: the engine's max_num_seqs)

    @property
    def instances_per_actor(self) -> int:
        return self.gen_gpus // GPU_COST["gpus_per_instance"] // self.actors

    @property
    def max_seqs_in_flight(self) -> int:
        return (self.cap_per_instance or GPU_COST["max_num_seqs"]) * self.instances_per_actor

    @property
    def label(self) -> str:
        if self.run == "a":
            return "a sync (colocated, in flight)"
        if self.run == "b":
            return f"b call-synchronous s={self.max_staleness}"
        return f"{self.run[0]} in flight{' + partial' if self.partial_rollout else ''} s={self.max_staleness}"


def mean_length(cost: CostModel) -> float:
    """Mean response length of the (capped) length model, in simulated tokens."""
    return float(cost.length.draw(np.random.default_rng(0), 400_000).mean())


def plan_in_flight(gpus: int, max_staleness: int, cost: CostModel, actors: int = GENERATION_ACTORS) -> dict:
    """Generation GPUs and in-flight cap per instance for an in-flight layout, by a grid search over an
    analytic model of the steady-state step time P (simulated seconds):

        train = train_seconds_per_token x step tokens / train GPUs + train_step_fixed_s
        gen   = decode tokens per step x tick(c) / (gen GPUs x c) + weight_sync_s          (throughput)
        tail  = (gen + cap length x tick(c) + train) / (max_staleness + 1) + weight_sync_s  (latency)
        P     = max(train, gen, tail)

    tick(c) = decode_step_s + decode_per_seq_s x c, with c the sequences decoding per instance.
    `tail` is the staleness bound at work: a group of step s may start only once version
    s - max_staleness is loaded, and step s trains only when its longest response is done. Every
    step has ~20 responses at the length cap (0.26% of 8192), so one of them is in a group that gets
    its slots only after most of the step has decoded (`gen`), and then decodes in a batch of c
    (cap length x tick(c)); all that must fit into max_staleness + 1 steps less one training. A
    larger c buys throughput and makes that response slower; the search picks the c and split with
    the smallest P. c is discounted by half a group per actor (a group starts when n slots are
    free). The DAG's own latency per step is not in the model (it is measured: `overhead`).

    At max_staleness 0 nothing of a later step competes for the slots and the batch drains as in
    sync (generation and training alternate), so the cap is the engine's max_num_seqs and the GPUs
    are split in half, as for the call-synchronous layout."""
    if max_staleness == 0:
        gen = gpus // 2
        return {"gen_gpus": gen, "cap_per_instance": cost.max_num_seqs,
                "step_s": round(sync_estimate(gpus, cost, gen_gpus=gen), 1)}
    mean = mean_length(cost)
    samples = GROUPS_PER_STEP * N_SAMPLES
    tokens, longest = samples * mean, cost.length.cap
    best = None
    for gen in range(actors, gpus, actors):
        instances = gen // cost.gpus_per_instance
        train = cost.train_seconds_per_token * samples * (mean + cost.prompt_tokens) / (gpus - gen) \
            + cost.train_step_fixed_s
        for cap in range(8, cost.max_num_seqs + 1, 4):
            if cap * instances // actors < N_SAMPLES:
                continue  # a group must fit
            tick = cost.tick_seconds(cap)
            busy = cap - N_SAMPLES / 2 / (instances / actors)
            gen_s = tokens * tick / (instances * busy) + cost.weight_sync_s
            tail = (gen_s + longest * tick + train) / (max_staleness + 1) + cost.weight_sync_s
            step = max(train, gen_s, tail)
            if best is None or step < best["step_s"]:
                best = {"gen_gpus": gen, "cap_per_instance": cap, "step_s": round(step, 1), "train_s": round(train, 1),
                        "gen_s": round(gen_s, 1), "tail_s": round(tail, 1)}
    return best


def sync_estimate(gpus: int, cost: CostModel, gen_gpus: int | None = None) -> float:
    """The same model's step time for sync: the longest response decodes while the batch drains from
    samples/gen GPUs to 1 (sum of ticks), then training, then the weight sync. Colocated (gen_gpus None):
    all GPUs do both; else gen_gpus decode and the rest train."""
    mean = mean_length(cost)
    samples = GROUPS_PER_STEP * N_SAMPLES
    gen_gpus = gen_gpus or gpus
    train_gpus = gpus if gen_gpus == gpus else gpus - gen_gpus
    decode = cost.length.cap * cost.decode_step_s + cost.decode_per_seq_s * samples / gen_gpus * mean
    train = cost.train_seconds_per_token * samples * (mean + cost.prompt_tokens) / train_gpus + cost.train_step_fixed_s
    return decode + train + cost.weight_sync_s


def layout_for(run: str, gpus: int, cost: CostModel, gen_gpus: int | None = None,
               cap: int | None = None) -> tuple[Layout, dict | None]:
    """The layout of one run of the ablation. In flight (c, d): the split and cap `plan_in_flight` picks,
    unless `gen_gpus` (a multiple of GENERATION_ACTORS) or `cap` (sequences per instance) are given."""
    per_actor_share = GROUPS_PER_STEP // GENERATION_ACTORS
    if run == "a":  # every group of a step at once: each actor takes its share, in calls of 4 groups
        calls = per_actor_share // GROUPS_PER_IN_FLIGHT_CALL
        return Layout(run, gpus, 0, True, True, False, gpus, gpus, GENERATION_ACTORS, GROUPS_PER_IN_FLIGHT_CALL,
                      calls), None
    if run == "b":
        gen = gpus // 2
        actors = min(gen, CALL_SYNC_ACTORS)
        return Layout(run, gpus, 2, False, False, False, gen, gpus - gen, actors,
                      GROUPS_PER_STEP // CALL_SYNC_CALLS_PER_STEP), None
    staleness = int(run[1:])
    plan = plan_in_flight(gpus, staleness, cost)
    if gen_gpus is not None or cap is not None:  # chosen by hand: the plan's figures no longer describe it
        plan = {"gen_gpus": gen_gpus or plan["gen_gpus"], "cap_per_instance": cap or plan["cap_per_instance"],
                "chosen": "by hand (--gen-gpus, --cap)"}
    instances = plan["gen_gpus"] // cost.gpus_per_instance // GENERATION_ACTORS
    # A group in flight holds only its unfinished responses' slots, so under a long tail several times
    # cap / n groups are in flight at once; give each actor calls enough for 4x that, plus one step's share.
    fill = math.ceil(plan["cap_per_instance"] * instances / (N_SAMPLES * GROUPS_PER_IN_FLIGHT_CALL))
    calls = 4 * fill + per_actor_share // GROUPS_PER_IN_FLIGHT_CALL
    return Layout(run, gpus, staleness, False, True, run[0] == "d", plan["gen_gpus"], gpus - plan["gen_gpus"],
                  GENERATION_ACTORS, GROUPS_PER_IN_FLIGHT_CALL, calls, plan["cap_per_instance"]), plan


# --- one run of the DAG ------------------------------------------------------------------

def init_sim_ray(gpus: int) -> None:
    import ray
    from ray import cloudpickle

    from pipelines.runtime.session import WORKER_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cloudpickle.register_pickle_by_value(sim_trainer)  # a script's neighbour, not an installed module
    ray.init(num_cpus=2, resources={"sim_gpu": gpus}, object_store_memory=512 * 2**20, include_dashboard=False,
             logging_level=os.environ.get("STREAMRL_RAY_LOG_LEVEL", "warning"),
             runtime_env={"env_vars": WORKER_ENV})


def job_config(layout: Layout, steps: int):
    from pipelines.config.load import load_config

    overrides = {
        "train.steps": steps, "train.groups_per_step": GROUPS_PER_STEP, "train.max_staleness": layout.max_staleness,
        "train.num_cpus": 0.05, "rollout.n": N_SAMPLES, "rollout.groups_per_call": layout.groups_per_call,
        "rollout.num_actors": layout.actors, "rollout.num_cpus": 0.05, "reward.num_cpus": 0.05,
        "rollout.max_seqs_in_flight": layout.max_seqs_in_flight, "rollout.calls_in_flight": layout.calls_in_flight,
        "tracking.enabled": False, "output_dir": tempfile.gettempdir(),
    }
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    # Set after validation: the config's Literal knows hf/vllm (the DAG passes the name to make_in_flight_engine),
    # and in_flight / partial_rollout are validated against that engine.
    cfg.rollout.engine = SIM_ENGINE
    cfg.rollout.in_flight = layout.in_flight
    cfg.rollout.partial_rollout = layout.partial_rollout
    return cfg


def prompt_table(count: int) -> pd.DataFrame:
    """Distinct prompts: the sim engine draws lengths per prompt, so every schedule gets the same workload."""
    return pd.DataFrame({
        "prompt_id": [f"q{i:06d}" for i in range(count)], "prompt": [f"question {i}" for i in range(count)],
        "answer": ["0"] * count,
    })


def scheduled_lengths(steps: int, cost: CostModel) -> list[np.ndarray]:
    """Each step's response lengths (simulated tokens) as the sim engines draw them for this script's
    schedule; the same in every run of the ablation (lengths are seeded by the prompt)."""
    from pipelines.dag import schedule_groups

    layout, _ = layout_for("a", GENERATION_ACTORS, cost)  # the schedule depends on groups per step, not the layout
    table = pd.concat(schedule_groups(prompt_table(steps * GROUPS_PER_STEP), job_config(layout, steps)))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cost.json"
        path.write_text(json.dumps(replace(cost, stats_dir=None).to_dict()))
        engine = SimEngine(str(path))
    try:
        return [np.concatenate(engine.draw_lengths(engine.encode(list(table.loc[table["train_step"] == step, "prompt"])),
                                                   N_SAMPLES)) for step in range(steps)]
    finally:
        engine.server.close()


def run_layout(layout: Layout, cost: CostModel, steps: int, workdir: Path) -> dict:
    """Run the real DAG once under `layout`; return per-step times (real), metrics rows and engine records."""
    import ray

    from pipelines.dag import build_rl_dataset, iter_steps, schedule_groups
    from pipelines.runtime.policy_store import create_policy_store

    tag = uuid.uuid4().hex[:8]
    share = 0.5 if layout.colocated else 1.0  # colocated: generation and training each hold half of every GPU
    stats_dir = workdir / f"engines-{tag}"
    engine_cost = replace(cost, instances=layout.instances_per_actor, train_gpus=layout.train_gpus,
                          stats_dir=str(stats_dir))
    cost_path = workdir / f"cost-{tag}.json"
    cost_path.write_text(json.dumps(engine_cost.to_dict()))
    store_name = f"streamrl-sim-policy-{tag}"
    store = create_policy_store(store_name)
    workers = sim_trainer.start_sim_trainers(str(cost_path), store, 1, {"sim_gpu": share * layout.train_gpus})
    cfg = job_config(layout, steps)
    schedule = schedule_groups(prompt_table(steps * GROUPS_PER_STEP), cfg)
    # Every Generate actor up before the first call is dispatched: an in-flight actor takes several calls at
    # once, and Ray Data gives them to whichever actor is up (then kills the idle ones once inputs run out).
    ray.data.DataContext.get_current().wait_for_min_actors_s = 600
    rows, times = [], []
    try:
        ds = build_rl_dataset(schedule, cfg, str(cost_path), store, workers,
                              remote_args={"generate": {"resources": {
                                  "sim_gpu": share * layout.gen_gpus / layout.actors}}})
        started = time.perf_counter()
        for row in iter_steps(ds):
            times.append(time.perf_counter() - started)
            rollouts = pd.read_parquet(io.BytesIO(row.pop("rollouts_parquet")))
            row["groups"] = rollouts[["group_uid", "train_step", "staleness", "policy_version",
                                      "policy_version_max"]].to_dict("list")
            rows.append(row)
    finally:
        for actor in [store, *workers]:
            ray.kill(actor)
    engines = [[json.loads(line) for line in path.read_text().splitlines() if line.strip()]
               for path in sorted(stats_dir.glob("*.jsonl"))]
    return {"layout": layout, "cost": engine_cost, "times": times, "rows": rows, "schedule": schedule,
            "engines": [records for records in engines if len(records) > 1]}


def _at(records: list[dict], key: str, t: float) -> float:
    """An engine's cumulative counter `key` at wall time t (linear between its samples)."""
    times = [r["t"] for r in records]
    return float(np.interp(t, times, [r[key] for r in records]))


def summarize(result: dict, time_scale: float) -> dict:
    """Simulated figures of one run. Throughput: steady state, from the end of step 1 to the end of the
    last step (start-up of Ray actors, unscaled real seconds, is kept out). Idle and overlap: the job's
    own report (pipelines/tracking/timeline.py: first generate start -> last train end), plus engine-instance
    utilisation from the sim engines' records over the same window."""
    from pipelines.tracking.timeline import overlap_report

    layout, times, rows = result["layout"], np.array(result["times"]), result["rows"]
    first = 1
    steps = len(times) - 1 - first
    sim_seconds = (times[-1] - times[first]) * time_scale
    samples = GROUPS_PER_STEP * N_SAMPLES
    overlap = overlap_report([row["timeline"] for row in rows])
    window_end = max(json.loads(row["timeline"])["train"][1] for row in rows)
    window_start = window_end - overlap["window_s"]
    busy = instances = active = 0.0
    for records in result["engines"]:
        busy += _at(records, "busy_instance_s", window_end) - _at(records, "busy_instance_s", window_start)
        active += _at(records, "active_sequence_s", window_end) - _at(records, "active_sequence_s", window_start)
        instances += records[-1]["instances"]
    updates = [r for records in result["engines"] for r in records if r["event"] == "update"]
    pauses = np.array([r["pause_s"] for r in updates]) * time_scale
    groups = pd.concat([pd.DataFrame(row["groups"]) for row in rows], ignore_index=True)
    span = groups["policy_version_max"] - groups["policy_version"]
    # Steady state: the window above ends with max_staleness steps that only waited for the trainer, which
    # flatters a run bound by its generation; without them (given max_staleness + 4 steps or more)
    steady = steady_seconds_per_step(list(times), first, layout.max_staleness, time_scale)
    steady_steps = len(times) - 1 - first - layout.max_staleness
    return {
        "run": layout.run, "schedule": layout.label, "gpus": layout.gpus, "max_staleness": layout.max_staleness,
        "in_flight": layout.in_flight, "partial_rollout": layout.partial_rollout,
        "gen_gpus": layout.gen_gpus, "train_gpus": layout.train_gpus, "generate_actors": layout.actors,
        "instances_per_actor": layout.instances_per_actor, "groups_per_call": layout.groups_per_call,
        "calls_in_flight_per_actor": layout.calls_in_flight,
        "max_seqs_in_flight_per_instance": layout.max_seqs_in_flight // max(layout.instances_per_actor, 1)
        if layout.in_flight else None,
        "steps_timed": steps, "sim_seconds": round(sim_seconds, 1),
        "sim_seconds_per_step": round(sim_seconds / steps, 2),
        "steady_sim_seconds_per_step": round(steady, 2) if steady is not None else None,
        "steady_steps_timed": steady_steps if steady is not None else 0,
        "sim_samples_per_s": round(samples * steps / sim_seconds, 2),
        "sim_tokens_per_s": round(sum(row["generated_tokens"] for row in rows[first + 1:])
                                  * result["cost"].token_unit / sim_seconds, 0),
        "generator_idle_fraction": round(overlap["generator_idle_fraction"], 3),
        "trainer_idle_fraction": round(overlap["trainer_idle_fraction"], 3),
        "overlap_efficiency": round(overlap["overlap_efficiency"], 3),
        "engine_instance_idle_fraction": round(1 - busy / (instances * overlap["window_s"]), 3) if instances else None,
        "mean_sequences_per_busy_instance": round(active / busy, 1) if busy else None,
        "staleness_histogram": {int(k): int(v) for k, v in sorted(Counter(groups["staleness"]).items())},
        "groups_spanning_versions": int((span > 0).sum()),
        "version_span_histogram": {int(k): int(v) for k, v in sorted(Counter(span).items())},
        "groups": len(groups),
        "weight_updates": len(updates),
        "sim_pause_per_update_s": {"mean": round(float(pauses.mean()), 2), "max": round(float(pauses.max()), 2)}
        if len(pauses) else None,
        "sim_time_weight_sync_per_group_s": round(float(np.mean([row["time_weight_sync"] for row in rows]))
                                                  * time_scale / GROUPS_PER_STEP, 2),
        "staleness_max": int(max(row["staleness_max"] for row in rows)),
        "real_seconds": round(float(times[-1]), 1),
    }


def check_invariants(result: dict) -> None:
    """The properties the DAG guarantees, checked on every simulated run."""
    layout, rows = result["layout"], result["rows"]
    uids = [uid for row in rows for uid in row["groups"]["group_uid"]]
    expected = [uid for frame in result["schedule"] for uid in frame["group_uid"]]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1)), "steps out of order or missing"
    assert sorted(uids) == sorted(expected) and len(set(uids)) == len(uids), "a group not trained exactly once"
    staleness = [s for row in rows for s in row["groups"]["staleness"]]
    assert 0 <= min(staleness) and max(staleness) <= layout.max_staleness, "staleness bound broken"
    if layout.max_staleness == 0:
        assert all(v == row["step"] - 1 for row in rows for v in row["groups"]["policy_version_max"]), "sync not on-policy"
    if not layout.partial_rollout:
        assert all(a == b for row in rows for a, b in zip(row["groups"]["policy_version"],
                                                          row["groups"]["policy_version_max"])), "a group spans versions"


# --- the sweep -------------------------------------------------------------------------

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


# --- calibration on this machine ---------------------------------------------------------

def calibrate(model_size: str, out: Path) -> dict:
    """Measure decode tick cost against batch size (HF forward with KV cache) and training
    cost per token (the real DeepSpeed TrainWorker) for a benchmark Llama on this CPU."""
    import torch
    from generate_throughput import build_model

    torch.set_num_threads(1)
    path, params = build_model(model_size, Path("/tmp/streamrl-bench-models"))
    decode = _measure_decode(path)
    train = _measure_train(path)
    batches = np.array([b for b, _ in decode], dtype=float)
    ticks = np.array([t for _, t in decode])
    b, a = np.polyfit(batches, ticks, 1)
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": model_size, "parameters": params, "torch_threads": 1,
        "decode_tick_seconds_by_batch": {int(k): round(v, 5) for k, v in decode},
        "decode_step_s": round(float(a), 5), "decode_per_seq_s": round(float(b), 6),
        "decode_fit_max_rel_error": round(float(np.max(np.abs(a + b * batches - ticks) / ticks)), 3),
        "train_seconds_per_token": train["seconds_per_token"], "train_runs": train["runs"],
        "ratio_train_token_over_decode_token_at_batch_64": round(
            train["seconds_per_token"] / ((a + b * 64) / 64), 2),
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def _measure_decode(path: Path, new_tokens: int = 24) -> list[tuple[int, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    results = []
    with torch.no_grad():
        for batch in (1, 4, 16, 32, 64):
            ids = torch.randint(3, vocab, (batch, 16))
            seconds = []
            for _ in range(2):
                out = model(ids, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(new_tokens):
                    out = model(token, past_key_values=past, use_cache=True)
                    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                seconds.append((time.perf_counter() - start) / new_tokens)
            results.append((batch, float(min(seconds))))
            print(f"calibrate: decode batch {batch:>3}: {min(seconds) * 1e3:.2f} ms/tick", flush=True)
    return results


def _measure_train(path: Path) -> dict:
    import ray

    from operators.workers.settings import TrainerSettings
    from operators.workers.train_worker import TrainWorker
    from pipelines.runtime.session import init_ray
    from pipelines.runtime.policy_store import create_policy_store
    from operators.workers.deepspeed_setup import free_port

    init_ray(num_cpus=2)
    try:
        store_name = f"calibrate-{uuid.uuid4().hex[:6]}"
        store = create_policy_store(store_name)
        settings = TrainerSettings(model_path=str(path), max_new_tokens=128)
        worker = ray.remote(TrainWorker).options(num_cpus=1).remote(0, 1, free_port(), settings, store)
        ray.get(worker.ready.remote())
        rng = np.random.default_rng(0)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        runs = []
        for batch, length in ((16, 64), (16, 128), (32, 128)):
            samples = {
                "prompt_token_ids": [[1, 5, 6, 7]] * batch,
                "response_token_ids": rng.integers(3, vocab, (batch, length)).tolist(),
                "behavior_logprobs": [[-1.0] * length] * batch,
                "advantages": rng.normal(size=batch).tolist(),
            }
            best = min(ray.get(worker.train_step.remote(samples, batch * length, batch))["train_seconds"]
                       for _ in range(2))
            tokens = batch * (length + 4)
            runs.append({"batch": batch, "response_tokens": length, "seconds": round(best, 3),
                         "seconds_per_token": best / tokens})
            print(f"calibrate: train {batch} x {length}: {best:.2f} s, {best / tokens * 1e3:.3f} ms/token", flush=True)
        ray.kill(worker)
        ray.kill(store)
    finally:
        ray.shutdown()
    return {"seconds_per_token": round(float(np.median([r["seconds_per_token"] for r in runs])), 6), "runs": runs}


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
        "cost_model_source": "assumed 7B / H100-class figures (see GPU_COST comments and benchmarks/README.md)",
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
    main()
