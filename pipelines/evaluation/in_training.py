"""Held-out evaluation while a job trains: an evaluator actor beside the DAG.

    policy store --(retained versions 0, every, 2*every, ..., steps)--> Evaluator actor
        Generate (its own engine; sampled n per prompt, and greedy) -> Reward -> eval metrics
    -> MLflow: eval/* at the step whose policy version was evaluated, eval/step_NNNNNN.parquet

The evaluator is one actor with its own engine, separate from the generate pool, so
training never waits for it: it asks the policy store for version v (the store keeps the
weights of the versions to evaluate until the evaluator has them), loads them, and scores
the held-out prompts with the same Generate and Reward operators the DAG uses. Its cost
is the compute it takes beside training (measured in the README); the job waits for it
only after the last step, for the final evaluation. It starts after the first trained step
(not beside the engines' and ranks' start-up) and runs at a lower CPU priority (`eval.nice`),
so on shared cores training goes first.

The same prompts, calls and seeds are what `streamrl eval` (pipelines/evaluation/job.py) uses, so
evaluating a checkpoint afterwards reproduces the figure logged during training.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from operators.algorithms.eval_metrics import FORMAT_COLUMN, summarize
from operators.stages.tables import to_parquet
from operators.weights.object_store import fetch
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.runtime.rollout_settings import environment_options, sandbox_limits

SCORED_COLUMNS = [
    "prompt_id", "prompt", "prompt_text", "mode", "policy_version", "responses", "response_lengths", "rewards", "reward_errors",
    FORMAT_COLUMN,  # when the job has the answer_format reward: accuracy among the answers given
]


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides an evaluation's samples, resolved from a job config."""

    n: int
    greedy: bool
    temperature: float
    max_new_tokens: int
    top_p: float
    seed: int
    prompts_per_call: int
    engine: str
    reward_functions: tuple[tuple[str, float, str], ...]  # (name, weight, style)
    on_error: float
    timeout_s: float
    success_threshold: float
    # multi-turn episodes (rollout.environment): name, options, max_turns, max_episode_tokens; evaluated as trained
    environment: dict | None = None
    sandbox_limits: object = None  # operators.environments.sandbox.SandboxLimits of the reward functions' child
    chat_template: str = "auto"  # how prompts are rendered (operators/common/prompts.py), as in training
    system_prompt: str | None = None

    @classmethod
    def of(cls, cfg: JobConfig) -> "EvalSettings":
        ev = cfg.eval
        return cls(
            n=ev.n, greedy=ev.greedy, temperature=ev.temperature or cfg.rollout.temperature,
            max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens, top_p=cfg.rollout.top_p,
            seed=cfg.train.seed, prompts_per_call=ev.prompts_per_call, engine=ev.engine or cfg.rollout.engine,
            reward_functions=tuple(cfg.reward.function_specs()), on_error=cfg.reward.on_error,
            timeout_s=cfg.reward.timeout_s, success_threshold=cfg.reward.success_threshold,
            sandbox_limits=sandbox_limits(cfg.sandbox),
            environment=None if cfg.rollout.environment is None else {**cfg.rollout.environment.model_dump(),
                                                                      "options": environment_options(cfg)},
            **cfg.prompt_options(held_out=True),
        )

    @property
    def modes(self) -> list[str]:
        return (["sampled"] if self.n else []) + (["greedy"] if self.greedy else [])

    def generate_kwargs(self, model_path: str, engine_options: dict, policy_version: int = 0) -> dict:
        return dict(
            model_path=model_path, engine=self.engine, n=max(self.n, 1), max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, engine_options=engine_options,
            policy_version=policy_version, chat_template=self.chat_template, system_prompt=self.system_prompt,
            **({} if self.environment is None else dict(
                in_flight=True, environment=self.environment["name"],
                environment_options=dict(self.environment["options"]), max_turns=self.environment["max_turns"],
                max_episode_tokens=self.environment["max_episode_tokens"],
                episode_timeout_s=self.environment.get("timeout_s", 300.0))),
        )

    def reward_kwargs(self) -> dict:
        return dict(functions=list(self.reward_functions), on_error=self.on_error, timeout_s=self.timeout_s,
                    limits=self.sandbox_limits)


def load_eval_prompts(cfg: JobConfig, model_path: str, echo: Callable[[str], None] = print) -> tuple[pd.DataFrame, str]:
    """The held-out prompts of `cfg.eval.data`: read, shuffled if asked, cut to eval.max_prompts, and
    checked row by row like the training prompts (problems are reported under eval.data)."""
    from pipelines.data.datasets import load_prompts
    from pipelines.data.prompt_checks import validate_prompts

    data = cfg.eval.data
    try:
        prompts, source = load_prompts(data)
    except ConfigError as err:
        raise ConfigError([(_under_eval(path), message) for path, message in err.problems], data.path) from None
    if data.shuffle:
        prompts = prompts.sample(frac=1.0, random_state=data.seed)
    prompts = prompts.head(cfg.eval.max_prompts).reset_index(drop=True)
    as_training = cfg.model_copy(update={
        "data": data, "rollout": cfg.rollout.model_copy(update={"max_new_tokens": EvalSettings.of(cfg).max_new_tokens}),
    })
    try:
        kept, dropped = validate_prompts(prompts, as_training, model_path, cfg.prompt_options(held_out=True))
    except ConfigError as err:
        raise ConfigError([(_under_eval(path), message) for path, message in err.problems], data.path) from None
    for kind, ids in dropped.items():
        echo(f"streamrl: eval: dropped {len(ids)} {kind.replace('_', ' ')} prompt(s) (eval.data.invalid_prompts: "
             f"drop), e.g. {', '.join(map(str, ids[:5]))}")
    return kept, source


def _under_eval(path: str) -> str:
    return f"eval.{path}" if path.startswith("data") else path


def eval_frames(prompts: pd.DataFrame, prompts_per_call: int) -> list[pd.DataFrame]:
    """The prompts cut into generate calls, in order: the call (and so its seed) of every prompt
    is the same in every evaluation of these prompts, in training and in `streamrl eval`."""
    return [prompts.iloc[start:start + prompts_per_call].reset_index(drop=True)
            for start in range(0, len(prompts), prompts_per_call)]


def scored_table(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Scored rows (Generate -> Reward output, with `mode`) as the columns eval Parquet files hold."""
    table = pd.concat(parts, ignore_index=True)
    for column in ("responses", "response_lengths", "rewards", FORMAT_COLUMN):
        if column in table.columns:
            table[column] = table[column].map(list)
    return table[[c for c in SCORED_COLUMNS if c in table.columns]]


class Evaluator:
    """Scores the held-out prompts with a given policy version (a Ray actor in the RL job).

    Holds its own Generate (engine) and Reward; `evaluate(v)` waits for version v in the policy
    store, loads it, and returns the metrics and the scored rows (Parquet bytes)."""

    def __init__(self, prompts: pd.DataFrame, settings: EvalSettings, model_path: str, engine_options: dict,
                 policy_store=None, nice: int = 0):
        """`nice`: lower this process's CPU priority by that much first, so its engine (a child process, which
        inherits it) starts and runs at that priority too."""
        from operators.stages.generate import Generate
        from operators.stages.reward import Reward

        if nice:
            os.nice(nice)
        self.frames = eval_frames(prompts, settings.prompts_per_call)
        self.settings = settings
        self.generate = Generate(**settings.generate_kwargs(model_path, engine_options))
        self.reward = Reward(**settings.reward_kwargs())
        self.store = policy_store  # the job's store (a PolicyStoreClient), or None

    def evaluate(self, version: int) -> dict:
        if version != self.generate.policy_version:
            weights_ref = self.store.weights_of(version)  # waits until it is published
            self.generate.load_policy(version, fetch(weights_ref))
            self.store.release(version)
        start = time.perf_counter()  # the evaluation's own cost, not the wait for training to get there
        parts = [
            self.reward(self.generate.sample(frame, greedy=mode == "greedy")).assign(mode=mode)
            for mode in self.settings.modes for frame in self.frames
        ]
        table = scored_table(parts)
        metrics = {**summarize(table, self.settings.success_threshold), "eval/time_s": time.perf_counter() - start}
        return {"version": version, "metrics": metrics, "parquet": to_parquet(table)}


def describe_eval(metrics: dict) -> str:
    """One line of an evaluation's headline figures."""
    parts = []
    if "eval/success_rate" in metrics:
        parts.append(f"success {metrics['eval/success_rate']:.3f}")
        best = max((k for k in metrics if k.startswith("eval/pass_at_")), key=lambda k: int(k.rsplit("_", 1)[1]))
        parts.append(f"pass@{best.rsplit('_', 1)[1]} {metrics[best]:.3f}")
    if "eval/greedy_success_rate" in metrics:
        parts.append(f"greedy {metrics['eval/greedy_success_rate']:.3f}")
    if "eval/greedy_answered_rate" in metrics:  # with answer_format: is the rise more than the format?
        parts.append(f"greedy answered {metrics['eval/greedy_answered_rate']:.3f}, right among answered "
                     f"{metrics['eval/greedy_success_among_answered']:.3f}")
    return ", ".join(parts) + f" ({metrics['eval/num_prompts']} prompts)"


class InTrainingEval:
    """The driver's side: starts the evaluator, queues one evaluation per version, logs each as it
    finishes (never waiting, except in `finish`). A failed evaluation is reported and skipped:
    evaluation must not stop training."""

    def __init__(
        self, cfg: JobConfig, prompts: pd.DataFrame, model_path: str, engine_options: dict, store,
        versions: list[int], tracker, echo: Callable[[str], None], rows: list[dict], artifacts_dir: Path,
    ):
        import ray

        ev = cfg.eval
        options = {"num_cpus": ev.num_cpus, "num_gpus": ev.num_gpus, "resources": ev.resources}
        options = {key: value for key, value in options.items() if value}
        self._start = lambda: ray.remote(Evaluator).options(**options).remote(
            prompts, EvalSettings.of(cfg), model_path, engine_options, store, ev.nice
        )
        self.actor = None  # started by the first poll: after the first trained step, not beside start-up
        self.versions = list(versions)
        self.pending: list[tuple[int, object]] = []
        self.tracker, self.echo, self.rows = tracker, echo, rows
        self.log_samples = ev.log_samples
        self.artifacts_dir = artifacts_dir

    def started(self) -> None:
        """Start the evaluator and queue its evaluations, once."""
        if self.actor is None:
            self.actor = self._start()
            self.pending = [(version, self.actor.evaluate.remote(version)) for version in self.versions]

    def poll(self, wait: bool = False, upto: int | None = None) -> None:
        """Log the evaluations that have finished, in version order (all of them when `wait`), up to version
        `upto`: the last step the terminal has shown (rows can reach the driver in bursts after the evaluator
        has scored their versions; an evaluation is said after its step). The first call starts the evaluator."""
        import ray

        from pipelines.recovery.resume import describe_failure

        self.started()
        while self.pending:
            version, ref = self.pending[0]
            if upto is not None and version > upto:
                return
            ready, _ = ray.wait([ref], timeout=None if wait else 0)
            if not ready:
                return
            self.pending.pop(0)
            try:
                result = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - evaluation is never worth a training job
                self.echo(f"streamrl: WARNING evaluation of policy version {version} failed "
                          f"({describe_failure(err)}); training goes on")
                continue
            self._log(result)

    def _log(self, result: dict) -> None:
        version, metrics = result["version"], result["metrics"]
        self.tracker.log_step({"step": version, **metrics})
        if self.log_samples:
            self.artifacts_dir.mkdir(parents=True, exist_ok=True)
            path = self.artifacts_dir / f"step_{version:06d}.parquet"
            path.write_bytes(result["parquet"])
            self.tracker.log_artifact(path, "eval")
        self.rows.append({"step": version, **metrics})
        self.echo(f"streamrl: eval at step {version} (policy version {version}): {describe_eval(metrics)}, "
                  f"{metrics['eval/time_s']:.1f}s")

    def finish(self) -> None:
        self.started()
        if self.pending:
            self.echo(f"streamrl: waiting for {len(self.pending)} evaluation(s) to finish")
        self.poll(wait=True)

    def close(self) -> None:
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
