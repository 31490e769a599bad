"""What a run is made from, as MLflow records it: the code version and the package versions (tags), and the
datasets it reads (dataset inputs: name, digest, source). The Tracker (pipelines/tracking/tracker.py) records a
job's; `streamrl eval` (pipelines/evaluation/job.py) records its held-out data on the run it evaluates.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

import pandas as pd

from pipelines.config.data import BUILTIN_DATASET_PREFIX
from pipelines.runtime.quiet import quiet_mlflow_dataset_sources

PACKAGES = ("torch", "ray", "deepspeed", "mlflow", "transformers", "pyarrow", "pydantic", "streamrl")
CODE_VERSION_ENV = "STREAMRL_CODE_VERSION"


def code_version() -> str:
    """The commit the job runs (git rev-parse HEAD), or what `streamrl submit` passed; else "unknown"."""
    # A submitted job runs from an uploaded copy without .git; `streamrl submit` passes the commit.
    if os.environ.get(CODE_VERSION_ENV):
        return os.environ[CODE_VERSION_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    """Tags `version.<package>`: the installed version of each of PACKAGES."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[f"version.{name}"] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[f"version.{name}"] = "not installed"
    return versions


def _dataset_source(source: str):
    """A file keeps its path; a builtin dataset or a reasoning_gym task is made by code, recorded as a code
    source (its split, seed and options are the run's data.* params; the digest tells two apart)."""
    from pipelines.data.reasoning_tasks import REASONING_GYM_PREFIX

    if source.startswith((BUILTIN_DATASET_PREFIX, REASONING_GYM_PREFIX)):
        from mlflow.data.code_dataset_source import CodeDatasetSource

        return CodeDatasetSource(tags={"streamrl.dataset": source, "code_version": code_version()})
    return source


def dataset_name(source: str) -> str:
    """The name a dataset input gets in MLflow: the file's name, or the builtin's."""
    return Path(source).name or source


def log_dataset_input(client, run, prompts: pd.DataFrame, source: str, context: str) -> str:
    """Log `prompts` as a dataset input of `run` (name, digest, source) unless the run has it; its digest."""
    import mlflow
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    quiet_mlflow_dataset_sources()  # a local file would warn that MLflow's one source class matches it twice
    dataset = mlflow.data.from_pandas(prompts, source=_dataset_source(source), name=dataset_name(source))
    if not any(item.dataset.digest == dataset.digest for item in run.inputs.dataset_inputs):
        # _to_mlflow_entity is private, but MlflowClient.log_inputs takes only the entity form.
        client.log_inputs(run.info.run_id, datasets=[
            DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])
        ])
    return dataset.digest
