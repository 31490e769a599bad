"""The simulation's workload and layouts: the modelled cluster's costs, how each run of the ablation
splits its GPUs (`layout_for`, `plan_in_flight`), the job's config and prompts, and the response
lengths the runs draw (`scheduled_lengths`). benchmarks/simulate_cluster.py says what the runs are.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks.sim_cost import CostModel
from benchmarks.sim_engine import ENGINE as SIM_ENGINE, SimEngine

ROOT = Path(__file__).resolve().parents[1]

# The modelled cluster: a 7B dense policy (Qwen2.5-7B-like: 7.6e9 parameters, bf16, GQA)
# on H100-class GPUs, one GPU per vLLM instance (TP=1). These are ASSUMPTIONS from public
# hardware figures, not measurements; benchmarks/studies/simulation.md gives the arithmetic. Unchanged
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
