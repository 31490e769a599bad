"""The trained policy as an MLflow model (pipelines/tracking/policy_model.py), against a real `mlflow server`.

The checkpoint is a real one: the tiny model after one DeepSpeed step, with its engine state and its
Hugging Face export, as a job's last checkpoint. Logged through a Tracker, it loads with
`mlflow.transformers.load_model`, holds the trained weights (not the base model's) and generates what
the checkpoint folder generates; it carries its lineage (step, policy version, checkpoint, the run's
dataset digests) and is an output of its run at that step. An outage delays it and it is logged once.
`test_tracking_outage.py`'s job test checks that a whole job logs its final checkpoint this way.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from test_checkpoint import ledger_for, worker_factory  # noqa: F401 - worker_factory is a fixture
from samples import step_samples
from test_tracking_outage import mlflow_http_env, server, server_process  # noqa: F401 - fixtures

from operators.algorithms.step_batch import explode
from pipelines.recovery.checkpoint import Checkpoint, CheckpointDir
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.tracking.tracker import Tracker
from pipelines.tracking.policy_model import RECORD_TAG, deliver, log_final_policy

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "3+4="


@pytest.fixture(scope="module")
def trained_checkpoint(worker_factory, tiny_model_path, tmp_path_factory) -> Checkpoint:  # noqa: F811
    """A job's last checkpoint after one real train step: engine state, ledger, Hugging Face export."""
    return after_one_step(worker_factory(), tiny_model_path, tmp_path_factory.mktemp("job"))


def after_one_step(worker, model_path: str, folder: Path) -> Checkpoint:
    """The job's checkpoint of `worker` after one train step, committed as a job commits it."""
    samples = explode(step_samples(model_path))
    worker.train_step(samples, sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"]))
    store = CheckpointDir(folder / "checkpoints" / "run")
    tmp = store.begin(1)
    worker.save_checkpoint(str(tmp))
    worker.save_pretrained(str(tmp), tokenizer=True)
    store.commit(tmp, 1, {"policy_version": 1, "model_path": model_path, "dataset_digest": "d1"},
                 ledger_for(range(1)))
    return store.at_step(1)


def tracker_for(server, tmp_path: Path, lines: list[str]) -> tuple[Tracker, object]:
    overrides = {"output_dir": str(tmp_path), "tracking.uri": server.uri, "tracking.experiment": "policy-model",
                 "data.num_prompts": 8}
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    prompts, source = load_prompts(cfg.data)
    tracker = Tracker(cfg, prompts, source, echo=lines.append)
    tracker.log_dataset(*load_prompts(cfg.eval.data), "eval")
    return tracker, cfg


def greedy_ids(model, tokenizer) -> list[int]:
    inputs = tokenizer(PROMPT, return_tensors="pt")
    return model.generate(**inputs, max_new_tokens=4, do_sample=False)[0].tolist()


def test_final_checkpoint_is_a_model_that_loads_generates_and_carries_its_lineage(server, trained_checkpoint,
                                                                                  tiny_model_path, tmp_path):
    lines: list[str] = []
    tracker, cfg = tracker_for(server, tmp_path, lines)
    log_final_policy(tracker, trained_checkpoint, cfg, lines.append)
    tracker.close()
    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)

    (output,) = run.outputs.model_outputs  # the run lists the model, at the checkpoint's step
    assert output.step == trained_checkpoint.step
    model = client.get_logged_model(output.model_id)
    assert model.status.name == "READY" and model.source_run_id == run.info.run_id
    assert model.experiment_id == run.info.experiment_id
    assert run.data.tags["model.latest_uri"] == model.model_uri and run.data.tags["model.latest_step"] == "1"
    assert any(f"logged as MLflow model {model.model_uri}" in line for line in lines), lines

    logged = {tag.value: item.dataset for item in run.inputs.dataset_inputs for tag in item.tags
              if tag.key == "mlflow.data.context"}
    lineage = {
        "step": "1", "policy_version": "1", "checkpoint_path": str(trained_checkpoint.path.resolve()),
        "checkpoint_artifact": "checkpoints/step_000001", "base_model": tiny_model_path, "prompts_digest": "d1",
        **{f"dataset.{context}.{key}": getattr(logged[context], key)
           for context in ("training", "eval") for key in ("name", "digest")},
    }
    assert {key: model.params.get(f"streamrl.{key}") for key in lineage} == lineage
    assert model.params["train.lr"] == run.data.params["train.lr"]  # and the job's config, as MLflow does
    info = mlflow.models.get_model_info(model.model_uri)
    assert {key: str(value) for key, value in info.metadata["streamrl"].items()} == {"run_id": run.info.run_id,
                                                                                     **lineage}
    assert info.run_id == run.info.run_id

    files = Path(mlflow.artifacts.download_artifacts(model.model_uri, dst_path=str(tmp_path / "download")))
    packaged = {path.name for path in (files / "model").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= packaged
    assert not packaged & {"engine", "rng", "ledger.parquet", "state.json", "MANIFEST.json"}

    pipe = mlflow.transformers.load_model(model.model_uri)
    trained = load_file(str(trained_checkpoint.path / "model.safetensors"))
    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    state = pipe.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in trained.items())
    assert any(not torch.equal(trained[name], base[name]) for name in trained)  # the step changed the policy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = AutoModelForCausalLM.from_pretrained(trained_checkpoint.path)
    assert greedy_ids(pipe.model, pipe.tokenizer) == greedy_ids(folder, AutoTokenizer.from_pretrained(
        trained_checkpoint.path))
    samples = pipe(PROMPT, max_new_tokens=4, do_sample=True, num_return_sequences=4, return_full_text=False)
    assert len(samples) == 4 and all(isinstance(s["generated_text"], str) for s in samples)
    assert any(s["generated_text"] for s in samples)


def test_an_outage_delays_the_model_and_it_is_logged_once(server, trained_checkpoint, tmp_path):
    lines: list[str] = []
    tracker, cfg = tracker_for(server, tmp_path, lines)
    server.stop()
    try:
        log_final_policy(tracker, trained_checkpoint, cfg, lines.append)  # returns at once: spooled
        assert not tracker.flush(3) and tracker.pending == 1
    finally:
        server.start()
    tracker.close()
    assert tracker.pending == 0 and not tracker.refused, lines
    client = MlflowClient(server.uri)
    experiment_id = client.get_run(tracker.run_id).info.experiment_id
    (op,) = [json.loads(line) for line in tracker.spool_path.read_text().splitlines()
             if json.loads(line)["op"] == "model"]
    # Delivered again (a crash between the upload and the spool's counter): the same model, not a second.
    again = deliver(client, tracker.run_id, op)["policy"]
    models = client.search_logged_models([experiment_id], filter_string=f"tags.`{RECORD_TAG}` = '{op['record']}'")
    assert [m.model_id for m in models] == [again.model_id] and again.status.name == "READY"
    assert client.get_run(tracker.run_id).data.tags["model.latest_id"] == again.model_id


def test_a_checkpoint_without_an_export_is_not_logged_and_says_why(server, tmp_path):
    lines: list[str] = []
    tracker, cfg = tracker_for(server, tmp_path, lines)
    store = CheckpointDir(tmp_path / "checkpoints" / "run")
    bare = store.commit(store.begin(2), 2, {"policy_version": 2}, ledger_for(range(2)))
    log_final_policy(tracker, store.at_step(2), cfg, lines.append)
    tracker.close()
    assert tracker.pending == 0 and not client_outputs(server, tracker.run_id)
    assert any("not logged as an MLflow model" in line and str(bare) in line for line in lines), lines


def client_outputs(server, run_id: str) -> list:
    outputs = MlflowClient(server.uri).get_run(run_id).outputs
    return list(outputs.model_outputs) if outputs else []


@pytest.fixture(scope="module")
def lora_checkpoint(worker_factory, tiny_model_path, tmp_path_factory) -> Checkpoint:  # noqa: F811
    """A LoRA job's last checkpoint after one real train step (adapters on every linear layer)."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")
    worker = worker_factory(**{"train.lora": "{r: 4, alpha: 8}", "train.lr": 0.05})
    return after_one_step(worker, tiny_model_path, tmp_path_factory.mktemp("lora-job"))


@pytest.mark.parametrize("merged", [False, True], ids=["adapter", "adapter-and-merged"])
def test_a_lora_policy_is_logged_as_its_adapter_which_loads_on_the_base_model(server, lora_checkpoint,
                                                                               tiny_model_path, tmp_path, merged):
    """train.lora: the model logged is peft's adapter folder (a few kB here) with the tokenizer, naming its
    base model; peft loads it on the base model and it computes what the checkpoint's merged export computes.
    tracking.log_merged_model logs the merged policy too. Delivered again, the same adapter model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines: list[str] = []
    tracker, cfg = tracker_for(server, tmp_path, lines)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"log_merged_model": merged})})
    log_final_policy(tracker, lora_checkpoint, cfg, lines.append)
    tracker.close()
    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    models = {client.get_logged_model(output.model_id).name: client.get_logged_model(output.model_id)
              for output in run.outputs.model_outputs}
    assert set(models) == ({"policy-adapter", "policy"} if merged else {"policy-adapter"}), models
    adapter = models["policy-adapter"]
    assert adapter.status.name == "READY" and adapter.source_run_id == run.info.run_id
    assert adapter.params["streamrl.base_model"] == tiny_model_path and adapter.params["streamrl.step"] == "1"
    assert run.data.tags["model.adapter_uri"] == adapter.model_uri
    assert ("model.latest_uri" in run.data.tags) == merged
    assert any("LoRA adapter of step 1 logged" in line for line in lines), lines

    files = Path(mlflow.artifacts.download_artifacts(adapter.model_uri, dst_path=str(tmp_path / "adapter")))
    names = {path.name for path in files.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names  # not the base weights
    config = json.loads((files / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == tiny_model_path
    assert {name.rsplit(".", 1)[-1] for name in config["target_modules"]} >= {"q_proj", "down_proj"}  # resolved

    tokenizer = AutoTokenizer.from_pretrained(files)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, files).eval()
        after = adapted(ids).logits
        merged_export = AutoModelForCausalLM.from_pretrained(lora_checkpoint.path, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(after, merged_export, atol=1e-5, rtol=1e-5)
    assert (after - before).abs().max() > 1e-3  # the adapter is a trained one, not peft's zero start

    (op,) = [json.loads(line) for line in tracker.spool_path.read_text().splitlines()
             if json.loads(line)["op"] == "model"]
    again = deliver(client, tracker.run_id, op)["adapter"]
    assert again.model_id == adapter.model_id
    assert [o.model_id for o in client.get_run(tracker.run_id).outputs.model_outputs].count(adapter.model_id) == 1
