"""MLflow lineage: what a user needs to walk from a checkpoint back to its prompts.

Per job: the flattened config as params; code and package versions as tags; the prompt
dataset as a dataset input (digest + source); one set of metrics per train step; each
step's rollouts as Parquet (prompt_id, group_uid, policy_version, train_step, ...); the
final checkpoint, tagged with the step that made it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
from pathlib import Path

import pandas as pd

from pipelines.config import BUILTIN_DATASET_PREFIX, JobConfig, flatten

PACKAGES = ("torch", "ray", "deepspeed", "mlflow", "transformers", "pyarrow", "pydantic", "streamrl")
NON_METRIC_COLUMNS = {"step", "rollouts_parquet"}
CODE_VERSION_ENV = "STREAMRL_CODE_VERSION"
# The line a job prints when its run starts; `streamrl submit` finds it in the job's logs.
RUN_ANNOUNCEMENT = re.compile(r"^streamrl: MLflow run (?P<run_id>\w+) (?P<url>\S+)", re.MULTILINE)


def announce_run(tracker) -> str:
    if tracker.run_id is None:
        return "streamrl: MLflow tracking disabled"
    return f"streamrl: MLflow run {tracker.run_id} {tracker.run_url}"


def _code_version() -> str:
    # A submitted job runs from an uploaded copy without .git; `streamrl submit` passes the commit.
    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[f"version.{name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[f"version.{name}"] = "not installed"
    return versions


def _dataset_source(source: str):
    """A file keeps its path; a builtin dataset is made by code, recorded as a code source."""
    if source.startswith(BUILTIN_DATASET_PREFIX):
        from mlflow.data.code_dataset_source import CodeDatasetSource

        return CodeDatasetSource(tags={"streamrl.dataset": source, "code_version": _code_version()})
    return source


class Tracker:
    """Records one job as one MLflow run. All MLflow calls of a job go through here."""

    def __init__(self, cfg: JobConfig, prompts: pd.DataFrame, source: str):
        import mlflow

        self.mlflow = mlflow
        self.output_dir = Path(cfg.output_dir).resolve()
        self.rollouts_dir = self.output_dir / "rollouts"
        mlflow.set_tracking_uri(cfg.tracking_uri())
        experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            # With the default sqlite store, keep artifacts beside the database, not in ./mlruns.
            location = (self.output_dir / "mlartifacts").as_uri() if cfg.tracking.uri is None else None
            mlflow.create_experiment(cfg.tracking.experiment, artifact_location=location)
        mlflow.set_experiment(cfg.tracking.experiment)
        self.run = mlflow.start_run(run_name=cfg.tracking.run_name)
        self.run_id = self.run.info.run_id
        self.log_rollouts = cfg.tracking.log_rollouts
        params = {key: str(value)[:6000] for key, value in flatten(cfg).items()}
        items = list(params.items())
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            mlflow.log_params(dict(items[start:start + 100]))
        mlflow.set_tags({"code_version": _code_version(), **_package_versions()})
        dataset = mlflow.data.from_pandas(prompts, source=_dataset_source(source), name=Path(source).name or source)
        mlflow.log_input(dataset, context="training")
        self.dataset_digest = dataset.digest

    @property
    def run_url(self) -> str:
        """The run's page on a tracking server, else the tracking URI (open it with `mlflow ui`)."""
        uri = self.mlflow.get_tracking_uri()
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self.run.info.experiment_id}/runs/{self.run_id}"
        return uri

    def log_step(self, row: dict) -> None:
        step = int(row["step"])
        metrics = {
            key: float(value) for key, value in row.items()
            if key not in NON_METRIC_COLUMNS and isinstance(value, (int, float)) and value == value
        }
        self.mlflow.log_metrics(metrics, step=step)
        if self.log_rollouts and row.get("rollouts_parquet") is not None:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            path = self.rollouts_dir / f"step_{step:06d}.parquet"
            path.write_bytes(row["rollouts_parquet"])
            self.mlflow.log_artifact(str(path), artifact_path="rollouts")

    def log_checkpoint(self, path: Path, step: int) -> str:
        artifact_path = f"checkpoints/step_{step:06d}"
        self.mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        self.mlflow.set_tags({"checkpoint.latest": artifact_path, "checkpoint.latest_step": str(step)})
        return artifact_path

    def set_tags(self, tags: dict) -> None:
        self.mlflow.set_tags({key: str(value) for key, value in tags.items()})

    def close(self, status: str = "FINISHED") -> None:
        self.mlflow.end_run(status=status)


class NullTracker:
    """Tracking off: same interface, records nothing."""

    run_id = None
    run_url = "(tracking disabled)"
    dataset_digest = None

    def log_step(self, row: dict) -> None: ...

    def log_checkpoint(self, path: Path, step: int) -> str:
        return str(path)

    def set_tags(self, tags: dict) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...
