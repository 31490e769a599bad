"""One run of the simulation: the real DAG under one layout (`run_layout`), on a local Ray cluster
whose accelerators are the custom resource `sim_gpu` (`init_sim_ray`); its simulated figures
(`summarize`) and the DAG's guarantees checked on it (`check_invariants`). benchmarks/simulate_cluster.py
runs the sweep.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks import sim_trainer
from benchmarks.sim_bound import steady_seconds_per_step
from benchmarks.sim_cost import CostModel
from benchmarks.sim_layout import GROUPS_PER_STEP, N_SAMPLES, Layout, job_config, prompt_table


def init_sim_ray(gpus: int) -> None:
    import ray

    from pipelines.runtime.session import WORKER_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, resources={"sim_gpu": gpus}, object_store_memory=512 * 2**20, include_dashboard=False,
             logging_level=os.environ.get("STREAMRL_RAY_LOG_LEVEL", "warning"),
             runtime_env={"env_vars": WORKER_ENV})


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
        store.kill()
        for actor in workers:
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
