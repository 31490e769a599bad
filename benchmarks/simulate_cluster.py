"""SIMULATION: the real GRPO DAG at 8, 32 and 128 simulated GPUs, async against synchronous.

    python benchmarks/simulate_cluster.py                 # -> results/simulation.json, simulation.png
    python benchmarks/simulate_cluster.py --gpus 8 --steps 8
    python benchmarks/simulate_cluster.py --calibrate     # -> results/sim_calibration.json

The DAG, scheduler, policy store, staleness gate, Ray Data backpressure and the Train
operator are the real ones (`pipelines.grpo`); only the engine (`operators/engines/sim.py`,
a continuous-batching cost model) and the trainer's compute (`sim_trainer.py`) are
modelled. Accelerators are a Ray custom resource `sim_gpu`; one actor stands for a group
of GPUs. Time runs `time_scale` times faster than simulated time; every figure printed
here is simulated seconds (real seconds x time_scale) and is labelled as simulation.

Schedules, for each GPU count N:
- sync: max_staleness 0, colocated: all N GPUs generate, then the same N GPUs train
  (each generation instance and the trainer hold half a `sim_gpu` per GPU: counted once).
- async: max_staleness 1 and 2, disaggregated: N_gen GPUs generate, N - N_gen train.
  Two ways to drive an engine instance:
  * `inproc`: the DAG as built today: each Generate actor runs one call at a time on its
    own instances (what `max_tasks_in_flight_per_actor=1` gives a real vLLM engine), so an
    instance idles through the tail of its call.
  * `shared`: k Generate actors per simulated server (a `SimServer` actor holding the
    GPUs), i.e. k calls in flight per engine instance: the next call fills the slots the
    tail frees. This is the behaviour a change to the DAG would give (see SIMULATION.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_trainer

from operators.engines.sim import CostModel, SimServer, SimServerPool

RESULTS = Path(__file__).parent / "results"

# The modelled cluster: a 7B dense policy (Qwen2.5-7B-like: 7.6e9 parameters, bf16, GQA)
# on H100-class GPUs, one GPU per vLLM instance (TP=1). These are ASSUMPTIONS from public
# hardware figures, not measurements; SIMULATION.md gives the arithmetic.
GPU_COST = {
    "decode_step_s": 0.008,  # TPOT of an 8B model on one H100 at batch 1: ~7-8 ms (weights 15 GB / 3.35 TB/s = 4.5 ms + overhead)
    "decode_per_seq_s": 1.0e-4,  # + ~0.1 ms per active sequence (KV reads at ~1-2k context, sampling): ~34 ms at 256
    "max_num_seqs": 256,
    "weight_sync_s": 3.0,  # pause of generation per new policy version (broadcast 15 GB + reload; colocated: reshard)
    "train_seconds_per_token": 1.54e-4,  # 8 x 7.6e9 FLOP/token (fwd+bwd 6N, proximal log-prob forward 2N) / (989e12 x 0.40 MFU)
    "train_step_fixed_s": 2.0,  # optimizer step and gradient all-reduce tail per step
    "prompt_tokens": 256,
    "gpus_per_instance": 1,
    "token_unit": 64,
    "length": {"median": 1000, "sigma": 1.0, "cap": 16384},  # reasoning-RL-like: mean ~1650, p99 ~10k, 0.26% capped
}
# 8192 samples per step (e.g. 512 prompts x 16 responses). Rows are few and wide: the DAG's
# overhead grows with rows and calls per step, not with samples; group size is not in the cost model.
GROUPS_PER_STEP = 16  # rows per step
N_SAMPLES = 512  # responses per row
MAX_SERVERS = 4  # actors holding generation GPUs (memory and CPU of this machine: ~150-200 MB each)
# Real seconds per simulated second, per GPU count: a synchronous step lasts ~15-25 s real, so the
# DAG's own per-step overhead (~1-2 s real on the shared 2-core machine) stays small beside it.
TIME_SCALE = {8: 60.0, 32: 20.0, 128: 12.0}


@dataclass(frozen=True)
class Layout:
    """How N simulated GPUs are used by one schedule."""

    gpus: int
    max_staleness: int
    mode: str  # "sync", "inproc" or "shared"
    gen_gpus: int
    train_gpus: int
    servers: int  # actors holding generation instances (Generate actors in sync/inproc)
    clients_per_server: int = 1
    calls_per_step: int = 0  # Generate calls per train step (sets groups_per_call)

    @property
    def instances_per_server(self) -> int:
        return self.gen_gpus // GPU_COST["gpus_per_instance"] // self.servers

    @property
    def generate_actors(self) -> int:
        return self.servers * self.clients_per_server

    @property
    def label(self) -> str:
        return "sync" if self.mode == "sync" else f"async-{self.mode} s={self.max_staleness}"


def sync_layout(gpus: int) -> Layout:
    servers = min(gpus, MAX_SERVERS)
    return Layout(gpus, 0, "sync", gpus, gpus, servers, 1, servers)


def async_layout(gpus: int, max_staleness: int, mode: str, gen_fraction: float, calls_per_step: int,
                 clients_per_server: int = 2) -> Layout:
    gen = max(1, round(gpus * gen_fraction))
    servers = min(gen, MAX_SERVERS if mode == "shared" else 2 * MAX_SERVERS)  # inproc: more actors than calls per step
    while gen % servers:
        servers -= 1
    clients = clients_per_server if mode == "shared" else 1
    return Layout(gpus, max_staleness, mode, gen, gpus - gen, servers, clients, calls_per_step)


def analytic_split(gpus: int, cost: CostModel) -> float:
    """Fraction of GPUs for generation that balances full-batch decode and training throughput."""
    mean_len = cost.length.median * math.exp(cost.length.sigma**2 / 2)
    decode_per_gpu = cost.max_num_seqs / cost.tick_seconds(cost.max_num_seqs) / cost.gpus_per_instance
    train_per_gpu = 1.0 / cost.train_seconds_per_token * mean_len / (mean_len + cost.prompt_tokens)
    return train_per_gpu / (train_per_gpu + decode_per_gpu)


# --- one run of the DAG ------------------------------------------------------------------

def init_sim_ray(gpus: int) -> None:
    import ray
    from ray import cloudpickle

    from pipelines.grpo import WORKER_ENV

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cloudpickle.register_pickle_by_value(sim_trainer)  # a script's neighbour, not an installed module
    ray.init(num_cpus=2, resources={"sim_gpu": gpus}, object_store_memory=512 * 2**20, include_dashboard=False,
             logging_level=os.environ.get("STREAMRL_RAY_LOG_LEVEL", "warning"),
             runtime_env={"env_vars": WORKER_ENV})


def job_config(layout: Layout, steps: int):
    from pipelines.config import load_config

    per_call = GROUPS_PER_STEP // layout.calls_per_step
    overrides = {
        "train.steps": steps, "train.groups_per_step": GROUPS_PER_STEP, "train.max_staleness": layout.max_staleness,
        "train.num_cpus": 0.05, "rollout.n": N_SAMPLES, "rollout.groups_per_call": per_call,
        "rollout.num_actors": layout.generate_actors, "rollout.num_cpus": 0.05, "reward.num_cpus": 0.05,
        "tracking.enabled": False, "output_dir": tempfile.gettempdir(),
    }
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    cfg.rollout.engine = "sim"  # the config's Literal knows hf/vllm; the DAG passes the name to make_engine
    return cfg


def prompt_table(count: int) -> pd.DataFrame:
    """Distinct prompts: the sim engine draws lengths per prompt, so every schedule gets the same workload."""
    return pd.DataFrame({
        "prompt_id": [f"q{i:06d}" for i in range(count)], "prompt": [f"question {i}" for i in range(count)],
        "answer": ["0"] * count,
    })


def run_layout(layout: Layout, cost: CostModel, steps: int, workdir: Path, echo=print) -> dict:
    """Run the real DAG once under `layout`; return per-step times (real) and metrics."""
    import ray

    from pipelines.grpo import build_rl_dataset, iter_steps, schedule_groups
    from pipelines.policy_store import create_policy_store

    tag = uuid.uuid4().hex[:8]
    colocated = layout.mode == "sync"
    share = 0.5 if colocated else 1.0  # colocated: generation and training each hold half of every GPU
    engine_cost = replace(cost, instances=layout.instances_per_server, train_gpus=layout.train_gpus)
    actors = []
    if layout.mode == "shared":
        server = ray.remote(SimServer).options(
            num_cpus=0, max_concurrency=4 * layout.clients_per_server + 4,
            resources={"sim_gpu": layout.gen_gpus / layout.servers})
        servers = [server.remote(engine_cost.to_dict()) for _ in range(layout.servers)]
        pool_name = f"sim-pool-{tag}"
        pool = ray.remote(SimServerPool).options(name=pool_name, num_cpus=0).remote(servers)
        actors += [*servers, pool]
        engine_cost = replace(engine_cost, server_pool=pool_name)
        generate_resources = {}
    else:
        generate_resources = {"resources": {"sim_gpu": share * layout.gen_gpus / layout.servers}}
    cost_path = workdir / f"cost-{tag}.json"
    cost_path.write_text(json.dumps(engine_cost.to_dict()))
    store_name = f"streamrl-sim-policy-{tag}"
    store = create_policy_store(store_name)
    workers = sim_trainer.start_sim_trainers(
        str(cost_path), store_name, 1, {"sim_gpu": share * layout.train_gpus})
    actors += [store, *workers]
    cfg = job_config(layout, steps)
    schedule = schedule_groups(prompt_table(steps * GROUPS_PER_STEP), cfg)
    rows, times = [], []
    try:
        ds = build_rl_dataset(schedule, cfg, str(cost_path), store_name, workers,
                              remote_args={"generate": generate_resources} if generate_resources else None)
        started = time.perf_counter()
        for row in iter_steps(ds):
            times.append(time.perf_counter() - started)
            rollouts = pd.read_parquet(__import__("io").BytesIO(row.pop("rollouts_parquet")))
            row["group_uids"] = rollouts["group_uid"].tolist()
            row["staleness_values"] = rollouts["staleness"].tolist()
            row["policy_versions"] = rollouts["policy_version"].tolist()
            row.pop("timeline", None)
            rows.append(row)
    finally:
        for actor in actors:
            ray.kill(actor)
    return {"layout": layout, "cost": engine_cost, "times": times, "rows": rows, "schedule": schedule}


def summarize(result: dict, time_scale: float) -> dict:
    """Simulated figures of one run. Steady state: from the end of step 1 to the end of the
    last step (start-up of Ray actors, unscaled real seconds, is kept out)."""
    layout, times, rows = result["layout"], np.array(result["times"]), result["rows"]
    first = 1
    steps = len(times) - 1 - first
    sim_seconds = (times[-1] - times[first]) * time_scale
    samples = GROUPS_PER_STEP * N_SAMPLES
    idle = [row["trainer_idle_fraction"] for row in rows[first + 1:]]
    return {
        "schedule": layout.label, "gpus": layout.gpus, "max_staleness": layout.max_staleness, "mode": layout.mode,
        "gen_gpus": layout.gen_gpus, "train_gpus": layout.train_gpus, "generation_actors": layout.servers,
        "instances_per_actor": layout.instances_per_server, "generate_clients": layout.generate_actors,
        "groups_per_call": GROUPS_PER_STEP // layout.calls_per_step,
        "steps_timed": steps, "sim_seconds": round(sim_seconds, 1),
        "sim_seconds_per_step": round(sim_seconds / steps, 2),
        "sim_samples_per_s": round(samples * steps / sim_seconds, 2),
        "sim_tokens_per_s": round(sum(row["generated_tokens"] for row in rows[first + 1:])
                                  * result["cost"].token_unit / sim_seconds, 0),
        "trainer_idle_fraction": round(float(np.mean(idle)), 3),
        "staleness_max": int(max(row["staleness_max"] for row in rows)),
        "real_seconds": round(float(times[-1]), 1),
    }


def check_invariants(result: dict) -> None:
    """The properties the DAG guarantees, checked on every simulated run."""
    layout, rows = result["layout"], result["rows"]
    uids = [uid for row in rows for uid in row["group_uids"]]
    expected = [uid for frame in result["schedule"] for uid in frame["group_uid"]]
    assert [row["step"] for row in rows] == list(range(len(rows))), "steps out of order or missing"
    assert sorted(uids) == sorted(expected) and len(set(uids)) == len(uids), "a group not trained exactly once"
    staleness = [s for row in rows for s in row["staleness_values"]]
    assert 0 <= min(staleness) and max(staleness) <= layout.max_staleness, "staleness bound broken"
    if layout.max_staleness == 0:
        assert all(v == row["step"] for row in rows for v in row["policy_versions"]), "sync not on-policy"


# --- the sweep -------------------------------------------------------------------------

def zero_cost(cost: CostModel) -> CostModel:
    """The same DAG with no modelled work: what remains per step is Ray/DAG overhead."""
    return replace(cost, decode_step_s=0.0, decode_per_seq_s=0.0, weight_sync_s=0.0, train_seconds_per_token=0.0,
                   train_step_fixed_s=0.0)


def sweep(gpu_counts: list[int], steps: int, time_scales: dict[int, float], runs: list[tuple[str, int]],
          calls_per_step: dict[str, int], gen_fraction: float | None, echo=print) -> dict:
    """For each GPU count: sync, then each (mode, max_staleness) in `runs`; then the same sync
    and the last async layout with zero modelled cost, to measure the DAG's own overhead."""
    import ray

    base = CostModel.from_dict(GPU_COST)
    records, overhead, split = [], [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for gpus in gpu_counts:
            cost = replace(base, time_scale=time_scales.get(gpus, 10.0))
            fraction = gen_fraction if gen_fraction is not None else max(analytic_split(gpus, cost), 0.5)
            split[gpus] = {"gen_fraction": fraction, "analytic_balance": round(analytic_split(gpus, cost), 3)}
            layouts = [sync_layout(gpus)] + [
                async_layout(gpus, staleness, mode, fraction, calls_per_step[mode]) for mode, staleness in runs
            ]
            init_sim_ray(gpus)
            try:
                for layout in layouts:
                    start = time.perf_counter()
                    result = run_layout(layout, cost, steps, Path(workdir), echo)
                    check_invariants(result)
                    record = {**summarize(result, cost.time_scale), "time_scale": cost.time_scale}
                    records.append(record)
                    echo(f"SIMULATION {gpus:>4} GPUs {record['schedule']:<22} gen/train {layout.gen_gpus}/{layout.train_gpus}"
                         f"  {record['sim_seconds_per_step']:>8.1f} sim s/step  staleness<= {record['staleness_max']}"
                         f"  idle {record['trainer_idle_fraction']:.2f}  ({time.perf_counter() - start:.0f} s real)")
                for layout in (layouts[0], layouts[-1]):
                    result = run_layout(layout, zero_cost(cost), steps, Path(workdir), echo)
                    times = np.array(result["times"])
                    per_step = float((times[-1] - times[1]) / (len(times) - 2))
                    overhead.append({"schedule": layout.label, "gpus": gpus, "real_seconds_per_step": round(per_step, 3),
                                     "as_sim_seconds_per_step": round(per_step * cost.time_scale, 1)})
                    echo(f"overhead {gpus} GPUs {layout.label}: {per_step:.3f} real s/step = "
                         f"{per_step * cost.time_scale:.1f} sim s/step")
            finally:
                ray.shutdown()
    for record in records:
        sync = next(r for r in records if r["gpus"] == record["gpus"] and r["mode"] == "sync")
        record["speedup_over_sync"] = round(sync["sim_seconds_per_step"] / record["sim_seconds_per_step"], 2)
        # The DAG's overhead is real seconds, scaled up like modelled work. If it were all on the
        # synchronous critical path and all hidden in async, the true speed-up would be this low:
        sync_overhead = next(o["as_sim_seconds_per_step"] for o in overhead if o["gpus"] == record["gpus"])
        own_overhead = next((o["as_sim_seconds_per_step"] for o in overhead
                             if o["gpus"] == record["gpus"] and o["schedule"] == record["schedule"]), None)
        record["speedup_if_overhead_removed_from_sync_only"] = round(
            (sync["sim_seconds_per_step"] - sync_overhead) / record["sim_seconds_per_step"], 2)
        if own_overhead is not None:  # and if it were additive in both (an upper estimate for async)
            record["speedup_if_overhead_removed_from_both"] = round(
                (sync["sim_seconds_per_step"] - sync_overhead) / (record["sim_seconds_per_step"] - own_overhead), 2)
    return {"cost_model": base.to_dict(), "time_scales": time_scales, "split": split, "records": records,
            "overhead": overhead}


def print_table(records: list[dict]) -> None:
    print("\nSIMULATION (cost-model engines and trainer inside the real DAG; simulated seconds)")
    print(f"{'GPUs':>5} {'schedule':<20}{'gen/train':>10}{'clients':>8}{'s/step':>9}{'samples/s':>10}"
          f"{'speed-up':>9}{'(low)':>7}{'idle':>6}{'stale':>6}")
    for r in records:
        print(f"{r['gpus']:>5} {r['schedule']:<20}{r['gen_gpus']:>5}/{r['train_gpus']:<4}{r['generate_clients']:>8}"
              f"{r['sim_seconds_per_step']:>9.1f}{r['sim_samples_per_s']:>10.1f}{r['speedup_over_sync']:>8.2f}x"
              f"{r['speedup_if_overhead_removed_from_sync_only']:>6.2f}x{r['trainer_idle_fraction']:>6.2f}"
              f"{r['staleness_max']:>6}")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = [s for s in dict.fromkeys(r["schedule"] for r in records) if s != "sync"]
    gpus = sorted({r["gpus"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(schedules), 1)
    for index, schedule in enumerate(schedules):
        values = [next((r["speedup_over_sync"] for r in records if r["gpus"] == g and r["schedule"] == schedule), 0)
                  for g in gpus]
        lows = [next((r["speedup_if_overhead_removed_from_sync_only"] for r in records
                      if r["gpus"] == g and r["schedule"] == schedule), 0) for g in gpus]
        x = np.arange(len(gpus)) + index * width
        bars = ax.bar(x, values, width, label=schedule)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.scatter(x, lows, marker="_", color="black", s=60, zorder=3,
                   label="floor: DAG overhead removed from sync only" if index == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=0.8, label="target 2.0x")
    ax.set_xticks(np.arange(len(gpus)) + width * (len(schedules) - 1) / 2, [f"{g} GPUs" for g in gpus])
    ax.set_ylabel("speed-up over synchronous (colocated)")
    ax.set_title("SIMULATION (cost models in the real DAG, not GPU measurements)\n"
                 "async GRPO over synchronous colocated; 7B policy, assumed H100 figures", fontsize=9)
    ax.set_ylim(0, max(2.2, max(r["speedup_over_sync"] for r in records)) * 1.35)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
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

    from operators.train_worker import TrainerSettings, TrainWorker
    from pipelines.grpo import init_ray
    from pipelines.policy_store import create_policy_store
    from pipelines.trainer_group import _free_port

    init_ray(num_cpus=2)
    try:
        store_name = f"calibrate-{uuid.uuid4().hex[:6]}"
        store = create_policy_store(store_name)
        settings = TrainerSettings(model_path=str(path), max_new_tokens=128)
        worker = ray.remote(TrainWorker).options(num_cpus=1).remote(0, 1, _free_port(), settings, store_name)
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
    parser.add_argument("--gpus", default="8,32,128", help="simulated GPU counts")
    parser.add_argument("--steps", type=int, default=6, help="train steps per run")
    parser.add_argument("--time-scale", type=float, default=None, help="simulated seconds per real second "
                        f"(default per GPU count: {TIME_SCALE})")
    parser.add_argument("--runs", default="inproc:2,shared:1,shared:2",
                        help="async runs as mode:max_staleness (modes: inproc, shared)")
    parser.add_argument("--calls-inproc", type=int, default=4, help="Generate calls per step, inproc mode")
    parser.add_argument("--calls-shared", type=int, default=8, help="Generate calls per step, shared mode")
    parser.add_argument("--gen-fraction", type=float, default=None, help="GPUs for generation (default: balanced)")
    parser.add_argument("--calibrate", action="store_true", help="measure per-token rates on this machine")
    parser.add_argument("--model-size", default="medium", help="calibration model (generate_throughput SIZES)")
    parser.add_argument("--name", default="simulation", help="result file stem")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.calibrate:
        record = calibrate(args.model_size, RESULTS / "sim_calibration.json")
        print(json.dumps(record, indent=2))
        return
    started = time.perf_counter()
    gpus = [int(g) for g in args.gpus.split(",")]
    scales = {g: args.time_scale or TIME_SCALE.get(g, 10.0) for g in gpus}
    runs = [(mode, int(staleness)) for mode, staleness in (item.split(":") for item in args.runs.split(","))]
    result = sweep(gpus, args.steps, scales, runs, {"inproc": args.calls_inproc, "shared": args.calls_shared},
                   args.gen_fraction)
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
        "cost_model_source": "assumed 7B / H100-class figures (see GPU_COST comments and SIMULATION.md)",
        "calibration_on_this_machine": json.loads(calibration.read_text()) if calibration.exists() else None,
        **result,
    }
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    plot(result["records"], RESULTS / f"{args.name}.png")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
