"""GRPO on the tiny arithmetic model in one process, no Ray, no MLflow: the algorithm end to end on a few screens.

    python -m pipelines.plain_loop --steps 20                       # configs/tiny_grpo.yaml, on the CPU
    python -m pipelines.plain_loop --steps 30 --set train.lr=0.002  # any config override, as `streamrl run --set`

Each step runs the project's own parts in the order the job's DAG runs them: Generate (the HF engine), Reward,
the advantage estimator, the step's samples, one TrainWorker.train_step, and the new weights into the engine.
The Ray job (pipelines/job.py) runs the same operators as a streaming DAG, with generation and training
overlapped; here each step waits for the one before (on-policy: staleness 0). Blocks are marked
`# algorithm:` or `# plumbing:` as CleanRL's are.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Callable

import numpy as np

from operators.algorithms.estimators import ADVANTAGE_ESTIMATORS, STEP_WHITENED, estimator_kind
from operators.algorithms.step_batch import explode, step_normalisers
from operators.stages.generate import Generate
from operators.stages.reward import Reward
from operators.workers.deepspeed_setup import free_port
from operators.workers.train_worker import TrainWorker
from pipelines.config.job import JobConfig
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.data.models import resolve_model_path
from pipelines.runtime.trainer_settings import trainer_settings
from pipelines.tracking.progress import summary_window

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_grpo.yaml"
# What one process needs in place of the job's settings: the HF engine (call-synchronous), no MLflow, and
# rollout.groups_per_call 1 (unused here: a step is one generate call; 1 divides any train.groups_per_step).
ONE_PROCESS = ["rollout.engine=hf", "tracking.enabled=false", "rollout.groups_per_call=1"]
EDGE = 5  # the summary compares the success rate of the first and the last EDGE steps


def unsupported(cfg: JobConfig) -> list[str]:
    """The config fields asking for what this loop leaves out (the Ray job runs all of it)."""
    algorithm = cfg.algorithm
    asked = {
        "algorithm.advantage (a per-group outcome estimator: grpo, rloo, ...)":
            estimator_kind(algorithm.advantage) != "outcome" or algorithm.advantage in STEP_WHITENED,
        "reference": cfg.reference is not None,
        "critic": cfg.critic is not None,
        "rollout.environment": cfg.rollout.environment is not None,
        "algorithm.dynamic_sampling": algorithm.dynamic_sampling,
        "algorithm.overlong_buffer": algorithm.overlong_buffer > 0,
        "algorithm.kl_reward_coef": algorithm.kl_reward_coef > 0,
    }
    return [field for field, on in asked.items() if on]


def run(cfg: JobConfig, model_path: str, watch: Callable | None = None, echo: Callable[[str], None] = functools.partial(print, flush=True)) -> list[dict]:
    """`cfg.train.steps` steps of the algorithm; one record per step, in order. `watch(record, generate, worker)`,
    when given, sees the parts after each step (a test compares the engine's weights with the trainer's)."""
    # plumbing: the prompts (the config's dataset: the arithmetic task's train split) and the three parts
    prompts, _ = load_prompts(cfg.data)
    generate = Generate(model_path, engine="hf", n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
                        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=cfg.train.seed,
                        **cfg.prompt_options())  # no policy store: it samples from the weights loaded now
    reward = Reward(cfg.reward.function_specs(), on_error=cfg.reward.on_error)
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.algorithm.advantage)  # grpo: (r - group mean) / (group std + eps)
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, model_path), None)  # no store: publishes nowhere
    records = []
    for step in range(cfg.train.steps):
        start = time.perf_counter()
        # algorithm: the step's prompt groups (G = train.groups_per_step), drawn from the dataset
        groups = prompts.sample(n=cfg.train.groups_per_step, random_state=cfg.data.seed + step)
        # algorithm: n responses per prompt from the current policy, with their behaviour log-probs
        batch = generate.sample(groups)
        # algorithm: one reward per response (the task's reward functions, weighted)
        batch = reward(batch)
        # algorithm: advantages relative to the group, [G, n] rewards -> [G, n] advantages
        rewards = np.array(batch["rewards"].tolist(), dtype=np.float64)  # [G, n]
        batch["advantages"] = [row.tolist() for row in estimator(rewards)]
        # algorithm: one sample per response, and the step's loss normalisers (trained tokens, responses)
        samples = explode(batch.to_dict("records"))
        tokens, sequences = step_normalisers(samples)
        # algorithm: one train step: the clipped policy loss, ppo_epochs x mini_batches optimizer steps
        result = worker.train_step(samples, tokens, sequences)
        # algorithm: the new policy into the engine, so the next step samples from it (on-policy)
        generate.load_policy(step + 1, worker.state_dict())
        # plumbing: the step's record and line
        record = {
            "step": step + 1, "reward_mean": float(rewards.mean()),
            "success_rate": float((rewards >= cfg.reward.success_threshold).mean()),
            "loss": result["policy_loss"], "grad_norm": result["grad_norm"], "num_tokens": result["num_tokens"],
            "seconds": time.perf_counter() - start,
        }
        records.append(record)
        echo(f"step {record['step']:3d}  reward {record['reward_mean']:.3f}  success {record['success_rate']:.3f}  "
             f"loss {record['loss']:+.4f}  ({record['seconds']:.1f} s)")
        if watch is not None:
            watch(record, generate, worker)
    generate.close()
    return records


def summary(records: list[dict]) -> str:
    """The success rate of the first and the last EDGE steps (fewer when the run is shorter than 2 x EDGE)."""
    edge = summary_window(len(records), EDGE)
    first = np.mean([r["success_rate"] for r in records[:edge]])
    last = np.mean([r["success_rate"] for r in records[-edge:]])
    return f"success rate: first {edge} steps {first:.3f}, last {edge} steps {last:.3f}"


def main(argv: list[str] | None = None) -> list[dict]:
    # plumbing: the config (the README's job, with what one process needs), the model, the loop, the summary
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a job config (default: configs/tiny_grpo.yaml)")
    parser.add_argument("--steps", type=int, default=None, help="train steps (default: the config's train.steps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. --set train.groups_per_step=4 (repeatable)")
    args = parser.parse_args(argv)
    steps = [f"train.steps={args.steps}"] if args.steps is not None else []
    cfg = load_config(args.config, ONE_PROCESS + args.set + steps)
    left_out = unsupported(cfg)
    if left_out:
        parser.error(f"this loop runs outcome-reward GRPO-style steps only; use `streamrl run` for {', '.join(left_out)}")
    model_path = resolve_model_path(cfg.model)  # builtin:tiny-arith: built once by pipelines/data/tiny_build.py, cached
    records = run(cfg, model_path)
    print(summary(records), flush=True)
    return records


if __name__ == "__main__":
    main()
