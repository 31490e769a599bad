"""The trained policy as an MLflow model: the final checkpoint's Hugging Face export, logged with
MLflow's transformers flavour (task text-generation) as an MLflow 3 logged model of the job's run.

    mlflow.transformers.load_model("models:/<model id>")   # a text-generation pipeline of the policy
    mlflow.pyfunc.load_model("models:/<model id>")         # the same behind pyfunc, for serving

It is linked the way MLflow 3 links a model: its source run is the job's run, which lists it as an
output at the checkpoint's step (the run's metrics at that step, the eval of that policy version and
the job summary, are linked to it too). Its lineage is in its params and in the `streamrl` entry of
its MLmodel metadata (which travels with the files):

    streamrl.step, streamrl.policy_version    the checkpoint's step and the policy version it holds
    streamrl.checkpoint_path                  the checkpoint folder on the job's disk
    streamrl.checkpoint_artifact              the same checkpoint among the run's artifacts
    streamrl.dataset.<context>.name / .digest each dataset input of the run (training, eval), as logged
    streamrl.base_model                       the model the job started from
    streamrl.prompts_digest                   streamrl's digest of the prompts (`streamrl lineage`)

plus the job's config (the run's params), as MLflow gives a model by default. A LoRA job's checkpoint
(train.lora) has peft's adapter folder beside its merged export (operators/workers/lora.py): it is logged as
the model `policy-adapter`, the adapter files and the tokenizer with the same params and no flavour
(`PeftModel.from_pretrained(base, mlflow.artifacts.download_artifacts(uri))` loads it on the base model
named by `streamrl.base_model`), and the merged policy as above only with tracking.log_merged_model. Only the
Hugging Face
files are packaged (config, weights, tokenizer): not engine/, rng/ or the ledger. Delivery goes through
the tracker's spool like any other record (pipelines/tracking/spool.py): an outage delays it, and delivering
it again (a retry after a partial upload, a resume) re-uses the logged model the first try created,
found by its `streamrl.record` tag, so a checkpoint is logged once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Iterator

from operators.workers.lora import ADAPTER_DIR, ADAPTER_FILES
from pipelines.recovery.checkpoint import CRITIC_DIR, ENGINE_DIR, LEDGER, MANIFEST, RNG_DIR, STATE, Checkpoint, step_dir_name
from pipelines.config.job import JobConfig

MODEL_NAME = "policy"
ADAPTER_MODEL_NAME = "policy-adapter"
RECORD_TAG = "streamrl.record"  # one per spool record: a retried delivery finds the model it created
# What a checkpoint holds beside the Hugging Face export (pipelines/recovery/checkpoint.py).
NOT_EXPORT = {ENGINE_DIR, RNG_DIR, CRITIC_DIR, LEDGER, STATE, MANIFEST, ADAPTER_DIR}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What the adapter model carries from the checkpoint's export besides the adapter: the tokenizer's files.
TOKENIZER_PARTS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


def adapter_folder(checkpoint_path: Path) -> Path | None:
    """The checkpoint's peft adapter folder (a LoRA job's), or None."""
    folder = checkpoint_path / ADAPTER_DIR
    return folder if all((folder / name).is_file() for name in ADAPTER_FILES) else None


def export_problem(folder: Path) -> str | None:
    """Why `folder` holds no Hugging Face export MLflow can package, or None."""
    config = folder / "config.json"
    if not config.is_file():
        return f"{folder} has no Hugging Face export (config.json); the last checkpoint always gets one"
    if not json.loads(config.read_text()).get("architectures"):
        return f"{config} names no architecture, which MLflow's transformers flavour needs"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"{folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)})"
    return None


def model_record(checkpoint: Checkpoint, cfg: JobConfig, datasets: dict[str, dict]) -> dict:
    """What the tracker spools to log `checkpoint` as a model: the folder, the step and the lineage.
    `datasets`: the run's dataset inputs by context ({"training": {"name": ..., "digest": ...}})."""
    lineage = {
        "step": checkpoint.step,
        "policy_version": checkpoint.state.get("policy_version", checkpoint.step),
        "checkpoint_path": str(checkpoint.path.resolve()),
        "checkpoint_artifact": f"checkpoints/{step_dir_name(checkpoint.step)}",
        "base_model": checkpoint.state.get("model_path") or cfg.model.path,
        # streamrl's own digest of the scheduled prompts: what `streamrl lineage` prints and --resume checks
        "prompts_digest": checkpoint.state.get("dataset_digest"),
        **{f"dataset.{context}.{key}": value for context, entry in datasets.items() for key, value in entry.items()},
    }
    adapter = adapter_folder(checkpoint.path)
    return {
        "path": lineage["checkpoint_path"], "step": checkpoint.step, "record": uuid.uuid4().hex,
        # a LoRA job: the adapter model, and the merged one only on request
        "adapter": str(adapter.resolve()) if adapter else None,
        "merged": adapter is None or cfg.tracking.log_merged_model,
        "lineage": {key: value for key, value in lineage.items() if value is not None},
        # pyfunc's default (256 new tokens) can overrun a small model's context; answer as in training
        "model_config": {"max_new_tokens": cfg.rollout.max_new_tokens},
    }


def log_final_policy(tracker, checkpoint: Checkpoint | None, cfg: JobConfig, echo: Callable[[str], None]) -> None:
    """Queue the job's final checkpoint as an MLflow model of its run (tracking.log_model). Never
    raises: a job that trained fine does not fail because its model could not be logged."""
    if tracker.run_id is None or checkpoint is None:
        return
    try:
        problem = export_problem(checkpoint.path)
        if problem is None and cfg.model.trust_remote_code:
            problem = (f"the model needs trust_remote_code, which loading it through MLflow would run; load "
                       f"{checkpoint.path} with from_pretrained instead")
        if problem is not None:
            echo(f"streamrl: warning: the policy is not logged as an MLflow model: {problem}")
            return
        tracker.log_model(model_record(checkpoint, cfg, tracker.datasets))
    except Exception as err:  # noqa: BLE001 - the job's result must not depend on it
        echo(f"streamrl: warning: the policy is not logged as an MLflow model ({type(err).__name__}: {err}); "
             f"the checkpoint {checkpoint.path} has it")


def deliver(client, run_id: str, op: dict) -> dict:
    """Log the models of spool record `op` for `run_id` (MLflow must be reachable): {"policy": the merged or
    full policy's LoggedModel, "adapter": a LoRA job's adapter model}, each None when not logged. MLflow's
    model logging works on the process's tracking URI, which the Tracker has set."""
    run = client.get_run(run_id)
    adapter = _deliver_adapter(client, run, op) if op.get("adapter") else None
    return {"policy": _deliver_policy(client, run, op) if op.get("merged", True) else None, "adapter": adapter}


def _logged_model(client, run, op: dict, name: str, record: str):
    """The logged model of this spool record (created by an earlier try of it), or a new one in the run's
    experiment with the run's params and the lineage."""
    experiment_id = run.info.experiment_id
    found = client.search_logged_models(
        [experiment_id], filter_string=f"tags.`{RECORD_TAG}` = '{record}'", max_results=1,
    )
    if found:
        return found[0]
    # created here, not by log_model: that would put it in the default experiment, not the run's
    params = {**run.data.params, **{f"streamrl.{key}": str(value) for key, value in op["lineage"].items()}}
    return client.create_logged_model(experiment_id, name=name, source_run_id=run.info.run_id, params=params,
                                      tags={RECORD_TAG: record})


def _is_output(run, model) -> bool:
    return any(output.model_id == model.model_id for output in (run.outputs.model_outputs if run.outputs else []))


def _deliver_adapter(client, run, op: dict):
    """A LoRA job's adapter as a model of its own: peft's adapter files and the tokenizer, no flavour; an
    output of the run at the checkpoint's step."""
    from mlflow.entities import LoggedModelOutput

    model = _logged_model(client, run, op, ADAPTER_MODEL_NAME, f"{op['record']}:adapter")
    with tempfile.TemporaryDirectory(prefix="streamrl-adapter-") as tmp:
        for source in [Path(op["adapter"]) / name for name in ADAPTER_FILES] + [
                Path(op["path"]) / name for name in TOKENIZER_PARTS]:
            if source.is_file():
                (Path(tmp) / source.name).symlink_to(source.resolve())
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, "READY")
    if not _is_output(run, model):
        client.log_outputs(run.info.run_id, [LoggedModelOutput(model.model_id, op["step"])])
    return client.get_logged_model(model.model_id)


def _deliver_policy(client, run, op: dict):
    """The (merged) policy as a transformers-flavour model."""
    import mlflow

    run_id = run.info.run_id
    model = _logged_model(client, run, op, MODEL_NAME, op["record"])
    # log_model records the model as an output of the run; a retry after that must not (the store refuses
    # the same link twice), so it passes no run: the model's source run is the link, set at creation.
    linked = _is_output(run, model)
    with _export_only(Path(op["path"])) as folder, _quiet("mlflow.transformers"):
        mlflow.transformers.log_model(
            str(folder), task="text-generation", model_id=model.model_id, run_id=None if linked else run_id,
            step=op["step"], metadata={"streamrl": {"run_id": run_id, **op["lineage"]}},
            model_card=_model_card(run_id, op["lineage"]),
            pip_requirements=_requirements(), model_config=op["model_config"],
        )
    return client.get_logged_model(model.model_id)


@contextlib.contextmanager
def _export_only(checkpoint: Path) -> Iterator[Path]:
    """A folder of links to the checkpoint's Hugging Face files: MLflow copies a local checkpoint
    folder whole, and the engine state beside the export is the larger part of it."""
    with tempfile.TemporaryDirectory(prefix="streamrl-model-") as tmp:
        folder = Path(tmp) / checkpoint.name
        folder.mkdir()
        for entry in checkpoint.iterdir():
            if entry.name not in NOT_EXPORT and not entry.name.startswith("."):
                (folder / entry.name).symlink_to(entry.resolve())  # copytree copies what a link points to
        yield folder


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Without MLflow's hub-oriented warnings for a local model (no license file found on the hub)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _model_card(run_id: str, lineage: dict):
    """Given, so MLflow does not look the model up on the Hugging Face hub (it has no hub name)."""
    from huggingface_hub import ModelCard

    rows = "\n".join(f"| {key} | {value} |" for key, value in lineage.items())
    return ModelCard(f"---\nlicense: other\n---\n# streamrl policy\n\nTrained by MLflow run {run_id}.\n\n"
                     f"| lineage | value |\n|---|---|\n{rows}\n")


def _requirements() -> list[str]:
    """Pinned; given, because MLflow's default list for a torch model adds torchvision, which
    loading the policy does not need and which may not be installed."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in ("transformers", "torch")]
