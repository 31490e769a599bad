"""`streamrl eval`: score a checkpoint on held-out prompts, as a plain Ray Data batch job.

    streamrl eval CHECKPOINT | RUN_ID [--step N] [--data FILE] [--reward NAME ...] [--set KEY=VALUE ...]

        prompts (Parquet / JSONL / CSV / builtin) -> Generate (the checkpoint's weights) -> Reward
        -> eval metrics + scored Parquet -> an MLflow run nested under the training run

Settings not given come from the run that wrote the checkpoint (its run.json): the reward
functions, the engine, temperature, max_new_tokens, seed, and `eval.*` (n, greedy,
max_prompts, prompts_per_call, and `eval.data` when `--data` is not given). With the run's
own eval settings the samples are those the job drew for the same policy version, so the
figure reproduces the one logged during training.

The same job from Python (see the README):

    settings = EvalSettings.of(cfg)
    ds = eval_dataset(eval_frames(prompts, settings.prompts_per_call), model_path, settings, greedy=False)
    metrics = summarize(ds.to_pandas().assign(mode="sampled"), settings.success_threshold)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from operators.algorithms.eval_metrics import summarize
from pipelines.recovery.checkpoint import RUN_FILE, Checkpoint, CheckpointDir, CheckpointError, verify
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import config_from_tree
from pipelines.evaluation.in_training import EvalSettings, describe_eval, eval_frames, load_eval_prompts, scored_table

PROGRESS_EVERY_S = 2.0


class EvalError(Exception):
    """What to evaluate cannot be found or used; the message names the fix."""


@dataclass
class EvalResult:
    metrics: dict
    scored: pd.DataFrame
    output: Path
    mlflow_run_id: str | None


# --- what to evaluate ------------------------------------------------------------------


def resolve_checkpoint(target: str, step: int | None = None, output_dir: str | None = None) -> Checkpoint:
    """A checkpoint folder, a run folder (its newest checkpoint) or a run id (searched under
    `output_dir`, default ./runs); `step` picks that step's checkpoint of the run."""
    from pipelines.tracking.lineage import LineageError, find_run_dir

    path = Path(target)
    if path.is_dir() and not (path / RUN_FILE).is_file():
        if step is not None:
            raise EvalError(f"--step is for a run; {target} is a folder: pass the run id or the run folder with --step")
        try:
            state = verify(path, hashes=False)
        except CheckpointError as err:
            raise EvalError(f"{target} is not a streamrl checkpoint ({err}); pass a folder "
                            ".../checkpoints/RUN_ID/step_NNNNNN, a run folder or a run id") from None
        return Checkpoint(path.resolve(), int(state["step"]), state)
    if path.is_dir():
        run_dir = path
    else:
        try:
            run_dir = find_run_dir(target, output_dir, instead="a checkpoint folder .../checkpoints/RUN_ID/step_NNNNNN")
        except LineageError as err:
            raise EvalError(str(err)) from None
    runs = CheckpointDir(run_dir.resolve())
    steps = [s for s, _ in runs.steps()]
    if step is not None:
        if step not in steps:
            raise EvalError(f"run {run_dir.name} has no checkpoint at step {step} (it has steps {steps or 'none'}); "
                            "pick one of those, or leave --step out for the newest")
        try:
            return runs.at_step(step)
        except CheckpointError as err:
            raise EvalError(f"the checkpoint of step {step} is damaged ({err}); evaluate another step") from None
    checkpoint = runs.latest_valid(echo=lambda _: None, hashes=False)
    if checkpoint is None:
        raise EvalError(f"run {run_dir.name} has no complete checkpoint yet (its job checkpoints every "
                        "train.checkpoint_every steps and after the last one); wait for one, or resume the run")
    return checkpoint


def _unflatten(flat: dict) -> dict:
    """The inverse of config.flatten: {'reward.functions.0.name': x} -> {'reward': {'functions': [{'name': x}]}}."""
    tree: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = tree
        for part, following in zip(parts, parts[1:]):
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    def lists(node):
        if isinstance(node, dict):
            if node and all(key.isdigit() for key in node):
                return [lists(node[key]) for key in sorted(node, key=int)]
            return {key: lists(child) for key, child in node.items()}
        return node

    return lists(tree)


def eval_config(checkpoint: Checkpoint, data: str | None = None, rewards: list[str] | None = None,
                overrides: list[str] | None = None) -> JobConfig:
    """The config of the run that wrote `checkpoint`, pointed at the checkpoint's weights and the eval data."""
    if not (checkpoint.path / "config.json").is_file():
        raise EvalError(f"{checkpoint.path} holds no Hugging Face export of the policy (only the last checkpoint "
                        "has one when train.checkpoint_hf_export: last); evaluate the run's final checkpoint")
    from pipelines.recovery.checkpoint import CheckpointError, read_run_file

    try:
        info = read_run_file(checkpoint.path.parent / RUN_FILE)
    except CheckpointError as err:
        raise EvalError(str(err)) from None
    if info is None:
        raise EvalError(f"{checkpoint.path.parent} has no {RUN_FILE}; it is not a streamrl run folder")
    if not isinstance(info.get("config"), dict):
        raise EvalError(f"{checkpoint.path.parent / RUN_FILE} holds no config; restore it from a copy, or give the "
                        "settings with --set")
    tree = _unflatten(info["config"])
    # The command line decides whether the checkpoint's code runs (--set model.trust_remote_code=true), not the
    # checkpoint's own run.json: a checkpoint from elsewhere must not be able to turn remote code on.
    tree["model"] = {**tree.get("model", {}), "path": str(checkpoint.path), "trust_remote_code": False}
    # the training prompts are not read; how they were rendered is kept (held-out prompts are rendered alike)
    tree["data"] = {key: value for key, value in (tree.get("data") or {}).items()
                    if key in ("chat_template", "system_prompt")}
    tree["output_dir"] = str(checkpoint.path.parent.parent.parent)  # <output_dir>/checkpoints/<run>/<step>
    if data is not None:
        tree["eval"] = {**(tree.get("eval") or {}), "data": {"path": data}}
    elif not tree.get("eval"):
        raise ConfigError([("--data", "the run has no eval.data; pass --data FILE (.parquet/.jsonl/.csv with a "
                                      "prompt column, and the columns its rewards need) or a builtin such as "
                                      "builtin:arithmetic-heldout")], "streamrl eval")
    if rewards:
        tree["reward"] = {**tree.get("reward", {}), "functions": [{"name": name, "weight": 1.0} for name in rewards]}
    try:
        return config_from_tree(tree, overrides, "streamrl eval")
    except ConfigError as err:  # name what was given on the command line by its flag
        raise ConfigError([(_cli_name(path, data), message) for path, message in err.problems],
                          "streamrl eval") from None


def _cli_name(path: str, data: str | None) -> str:
    """Problems of what was given on the command line are named by its flag."""
    if data is not None and path == "eval.data.path":
        return "--data"
    if data is not None and path == "eval.data.prompt_column":
        return "--data (prompt column; --set eval.data.prompt_column=NAME)"
    if path.startswith("reward.functions"):
        return f"{path} (--reward)"
    return path


# --- the job ---------------------------------------------------------------------------


def eval_dataset(frames: list[pd.DataFrame], model_path: str, settings: EvalSettings, greedy: bool,
                 engine_options: dict | None = None, policy_version: int = 0, num_cpus: float = 0.5,
                 num_gpus: float = 0):
    """read -> Generate -> Reward on `frames` (one generate call each): a Ray Data Dataset of scored rows."""
    import ray
    from ray.data import ActorPoolStrategy

    from operators.stages.generate import Generate
    from operators.stages.reward import Reward
    from pipelines.runtime.placement import map_stage

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # scored rows in prompt order
    ds = ray.data.from_pandas(frames)
    ds = map_stage(
        ds, Generate, fn_constructor_kwargs={
            **settings.generate_kwargs(model_path, engine_options or {}, policy_version), "greedy": greedy,
        },
        compute=ActorPoolStrategy(size=1), batch_size=None, batch_format="pandas",
        options={"num_cpus": num_cpus, "num_gpus": num_gpus or None},
    )
    return map_stage(ds, Reward, fn_constructor_kwargs=settings.reward_kwargs(), compute=ActorPoolStrategy(size=1),
                     batch_size=None, batch_format="pandas", options={"num_cpus": 0.1})


def _score(frames, cfg: JobConfig, settings: EvalSettings, checkpoint: Checkpoint, echo) -> pd.DataFrame:
    from pipelines.stages import engine_options

    parts, total = [], sum(len(frame) for frame in frames)
    started = time.perf_counter()
    for mode in settings.modes:
        ds = eval_dataset(frames, str(checkpoint.path), settings, mode == "greedy", engine_options(cfg, settings.engine, adapters=False),
                          checkpoint.step, cfg.eval.num_cpus, cfg.eval.num_gpus)
        done, shown = 0, 0.0
        for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
            parts.append(batch.assign(mode=mode))
            done += len(batch)
            now = time.perf_counter() - started
            if now - shown >= PROGRESS_EVERY_S or done == total:
                echo(f"streamrl eval: {mode} {done}/{total} prompts scored ({now:.0f}s)")
                shown = now
    return scored_table(parts)


def evaluate_checkpoint(cfg: JobConfig, checkpoint: Checkpoint, output: str | None = None,
                        echo: Callable[[str], None] = print) -> EvalResult:
    """Score `checkpoint` on cfg.eval.data; log an MLflow run linked to the training run (tracking.enabled)."""
    from pipelines.runtime.session import ray_session

    settings = EvalSettings.of(cfg)
    prompts, source = load_eval_prompts(cfg, str(checkpoint.path), echo)  # bad rows: exit 2, nothing started
    from pipelines.recovery.checkpoint import CheckpointError, checked_run_id

    try:  # the id becomes a folder name and an MLflow lookup: the checkpoint's state.json is not trusted with it
        run_id = checked_run_id(checkpoint.state.get("run_id") or checkpoint.path.parent.name,
                                f"{checkpoint.path / 'state.json'} run_id")
    except CheckpointError as err:
        raise EvalError(str(err)) from None
    out = Path(output) if output else (Path(cfg.output_dir) / "eval" / run_id / f"checkpoint_{checkpoint.path.name}.parquet")
    tracking = EvalTracking(cfg, run_id, checkpoint, prompts, source, settings) if cfg.tracking.enabled else None
    echo(f"streamrl eval: {len(prompts)} prompts of {source}, policy version {checkpoint.step} "
         f"({checkpoint.path}), modes {'+'.join(settings.modes)}, n={settings.n}")
    status = "FAILED"
    try:
        with ray_session(cfg):
            scored = _score(eval_frames(prompts, settings.prompts_per_call), cfg, settings, checkpoint, echo)
        metrics = summarize(scored, settings.success_threshold)
        out.parent.mkdir(parents=True, exist_ok=True)
        scored.to_parquet(out, index=False)
        if tracking is not None:
            tracking.log(metrics, out)
        status = "FINISHED"
    finally:
        if tracking is not None:
            tracking.close(status)
    return EvalResult(metrics, scored, out, tracking.eval_run_id if tracking else None)


class EvalTracking:
    """The eval's MLflow run: in the training run's experiment, nested under it (mlflow.parentRunId),
    tagged with the checkpoint's step and path; the eval dataset as an input (digest)."""

    def __init__(self, cfg: JobConfig, run_id: str, checkpoint: Checkpoint, prompts: pd.DataFrame, source: str,
                 settings: EvalSettings):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        from pipelines.config.load import flatten
        from pipelines.tracking.run_inputs import log_dataset_input

        self.client = client = MlflowClient(cfg.tracking_uri())
        self.step = checkpoint.step
        try:
            training = client.get_run(run_id)
            experiment_id, parent = training.info.experiment_id, {MLFLOW_PARENT_RUN_ID: run_id}
        except MlflowException:  # an untracked run (local-...), or another tracking store
            training, parent = None, {}
            found = client.get_experiment_by_name(cfg.tracking.experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(cfg.tracking.experiment)
        tags = {**parent, "streamrl.eval.of_run": run_id, "streamrl.eval.checkpoint_step": str(checkpoint.step),
                "streamrl.eval.checkpoint_path": str(checkpoint.path), "streamrl.eval.policy_version": str(checkpoint.step)}
        run = client.create_run(experiment_id, tags=tags, run_name=f"eval-step{checkpoint.step}")
        self.eval_run_id = run.info.run_id
        self.training_run_id = training.info.run_id if training else None
        params = {key: str(value)[:6000] for key, value in flatten(cfg).items()
                  if key.startswith(("eval.", "reward.", "rollout.engine", "model."))}
        params.update({"eval.temperature": settings.temperature, "eval.max_new_tokens": settings.max_new_tokens})
        items = [Param(key, str(value)) for key, value in params.items()]
        for start in range(0, len(items), 100):
            client.log_batch(self.eval_run_id, params=items[start:start + 100])
        log_dataset_input(client, run, prompts, source, "eval")

    def log(self, metrics: dict, scored_file: Path) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, self.step) for key, value in metrics.items()]
        self.client.log_batch(self.eval_run_id, metrics=items)
        self.client.log_artifact(self.eval_run_id, str(scored_file), "eval")
        if self.training_run_id:  # the training run points at its latest evaluation too
            self.client.set_tag(self.training_run_id, "streamrl.eval.latest_run", self.eval_run_id)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.eval_run_id, status)


def eval_command(args, echo: Callable[[str], None] = print) -> dict:
    """`streamrl eval` without the exit codes: raises EvalError / ConfigError for bad input."""
    checkpoint = resolve_checkpoint(args.target, args.step, args.output_dir)
    cfg = eval_config(checkpoint, args.data, args.rewards, args.overrides)
    result = evaluate_checkpoint(cfg, checkpoint, args.output, echo)
    summary = {"checkpoint": str(checkpoint.path), "step": checkpoint.step, "scored": str(result.output),
               "mlflow_run_id": result.mlflow_run_id, "metrics": result.metrics}
    echo(f"streamrl eval: step {checkpoint.step}: {describe_eval(result.metrics)}")
    echo(f"streamrl eval: scored responses in {result.output}"
         + (f"; MLflow run {result.mlflow_run_id} ({cfg.tracking_uri()})" if result.mlflow_run_id else ""))
    return summary
