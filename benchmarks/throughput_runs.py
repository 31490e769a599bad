"""One mode of benchmarks/throughput.py, run: the plain loop (`run_plain`: one process, no Ray, the floor for
framework overhead) or the DAG (`run_dag`, with the ledger's and the engines' `schedule_figures`); each
returns the per-step timelines the script's overlap report reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def run_plain(cfg, model_path: str) -> list[dict]:
    """The same work in one process, in turn, no Ray: the floor for framework overhead."""
    import torch

    from operators.stages.advantage import Advantage
    from operators.stages.generate import Generate
    from operators.stages.reward import Reward
    from operators.algorithms.step_batch import explode
    from operators.workers.train_worker import TrainWorker
    from pipelines.data.datasets import load_prompts
    from pipelines.dag import schedule_groups
    from pipelines.stages import engine_options
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    torch.set_num_threads(cfg.train.torch_threads)
    prompts, _ = load_prompts(cfg.data)
    calls = schedule_groups(prompts, cfg)
    generate = Generate(
        model_path, engine=cfg.rollout.engine, n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=cfg.train.seed,
        engine_options=engine_options(cfg),
    )
    reward = Reward(cfg.reward.function_specs(), on_error=cfg.reward.on_error)
    advantage = Advantage(cfg.algorithm.advantage)
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, model_path), None)
    timelines = []
    for step in range(cfg.train.steps):
        rows, intervals = [], []
        for frame in (c for c in calls if int(c["train_step"].iloc[0]) == step):
            for out in generate(frame):
                intervals.append(("plain", float(out["generate_start"].iloc[0]), float(out["generate_end"].iloc[0])))
                rows.extend(advantage(reward(out)).to_dict("records"))
        start = time.time()
        samples = explode(rows)
        tokens = int(sum(len(t) for t in samples["response_token_ids"]))
        result = worker.train_step(samples, tokens, len(samples["advantages"]))
        generate.engine.load_weights(worker.state_dict())  # on-policy: the next step samples the new weights
        generate.policy_version = step + 1
        end = time.time()
        rewards = [r for row in rows for r in row["rewards"]]
        timelines.append({
            "train": (start, end), "generate": intervals, "step": step, "generated_tokens":
            int(sum(sum(row["response_lengths"]) for row in rows)), "samples": len(samples["advantages"]),
            "reward_mean": sum(rewards) / len(rewards), "policy_loss": result["policy_loss"], "staleness_max": 0,
        })
        print(f"plain step {step + 1}/{cfg.train.steps} generate {sum(e - s for _, s, e in intervals):.1f}s "
              f"train {end - start:.1f}s", flush=True)
    return timelines


def run_dag(cfg, ray_timeline: str | None = None) -> tuple[list[dict], str | None, dict]:
    import ray

    from pipelines.job import run_job
    from pipelines.runtime.memory import local_object_store_mb
    from pipelines.runtime.session import init_ray

    init_ray(num_cpus=cfg.ray.num_cpus, object_store_memory_mb=local_object_store_mb(cfg, None))
    try:
        result = run_job(cfg)
        if ray_timeline:  # Ray's own task/actor-call trace (chrome://tracing, Perfetto)
            ray.timeline(filename=ray_timeline)
    finally:
        ray.shutdown()
    timelines = []
    for row in result.metrics.to_dict("records"):
        timelines.append({
            **json.loads(row["timeline"]), "step": int(row["step"]), "generated_tokens": int(row["generated_tokens"]),
            "samples": int(row["num_groups"]) * cfg.rollout.n, "reward_mean": row["reward_mean"],
            "policy_loss": row["policy_loss"], "staleness_max": int(row["staleness_max"]),
        })
    return timelines, result.run_id, schedule_figures(result)


def schedule_figures(result) -> dict:
    """Staleness histogram (of each group's oldest token), groups that spanned a weight update, and the
    in-flight engine's pause per update."""
    import pandas as pd

    from pipelines.recovery.checkpoint import LEDGER

    ledger = pd.read_parquet(Path(result.checkpoint) / LEDGER) if result.checkpoint else pd.DataFrame()
    figures = {"staleness_histogram": {str(k): int(v) for k, v in ledger["staleness"].value_counts().sort_index().items()}
               if len(ledger) else {}}
    if "policy_version_max" in ledger:
        figures["groups_spanning_versions"] = int((ledger["policy_version_max"] > ledger["policy_version"]).sum())
    updates = result.weight_updates
    if len(updates):
        figures.update(weight_updates=len(updates), weight_pause_s_median=float(updates["pause_s"].median()),
                       weight_pause_s_max=float(updates["pause_s"].max()),
                       weight_load_s_median=float(updates["load_s"].median()),
                       weight_pull_prepare_s_median=float((updates["pull_s"] + updates["prepare_s"]).median()))
    return figures
