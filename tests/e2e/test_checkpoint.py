"""Checkpoints and the NaN guard, below the job: atomic writes, damage detection, an exact
DeepSpeed round trip (model + optimizer + RNG), non-finite losses and weights, resume checks
and `streamrl lineage`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from operators.algorithms.step_batch import explode
from operators.stages.train import LEDGER_COLUMNS
from pipelines.recovery.checkpoint import CheckpointDir, CheckpointError, verify
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.recovery.resume import check_can_resume, config_changes, is_process_death, resolve_run, run_file_info
from samples import step_samples

ROOT = Path(__file__).resolve().parents[2]


def ledger_for(steps: range) -> pd.DataFrame:
    rows = [
        {"train_step": s, "group_uid": f"s{s:06d}-g0000", "prompt_id": f"p{s}", "epoch": 0, "policy_version": s,
         "staleness": 0, "trained": True}
        for s in steps
    ]
    return pd.DataFrame(rows, columns=LEDGER_COLUMNS)


def write_checkpoint(store: CheckpointDir, step: int, payload: bytes = b"weights") -> Path:
    tmp = store.begin(step)
    (tmp / "engine").mkdir()
    (tmp / "engine" / "model.bin").write_bytes(payload * 1000)
    return store.commit(tmp, step, {"policy_version": step, "run_id": "r"}, ledger_for(range(step)))


def test_commit_is_atomic_and_damage_is_detected(tmp_path):
    store = CheckpointDir(tmp_path / "run")
    write_checkpoint(store, 2)
    four = write_checkpoint(store, 4)
    assert store.latest_valid().step == 4
    # A job that died while writing step 6 left only a hidden folder: step 4 stays the latest.
    partial = store.begin(6)
    (partial / "engine").mkdir()
    (partial / "engine" / "model.bin").write_bytes(b"half")
    assert store.latest_valid().step == 4
    assert store.clean_partial() == [partial] and not partial.exists()
    # A damaged file (same size, other bytes) fails the hash; a truncated one the size.
    blob = four / "engine" / "model.bin"
    blob.write_bytes(b"x" * blob.stat().st_size)
    with pytest.raises(CheckpointError, match="sha256"):
        verify(four)
    messages = []
    assert store.latest_valid(echo=messages.append).step == 2
    assert "skipping checkpoint" in messages[0] and "step_000004" in messages[0]
    blob.write_bytes(b"short")
    with pytest.raises(CheckpointError, match="wrong size"):
        verify(four)
    (four / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="not completely written"):
        verify(four)
    # Pruning keeps the newest and never the protected one.
    for step in (6, 8):
        write_checkpoint(store, step)
    store.prune(keep=2)
    assert [s for s, _ in store.steps()] == [6, 8]
    assert store.at_step(8).ledger()["train_step"].tolist() == list(range(8))


@pytest.fixture(scope="module")
def worker_factory(tiny_model_path):
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    def make(store=None, **extra):
        sets = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1", "train.lr=0.01",
                *[f"{k}={v}" for k, v in extra.items()]]
        cfg = load_config(None, sets)
        return TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), store)

    return make


def test_engine_round_trip_continues_exactly(worker_factory, tiny_model_path, tmp_path):
    samples = explode(step_samples(tiny_model_path))
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"])
    worker = worker_factory()
    worker.train_step(samples, tokens, count)
    worker.save_checkpoint(str(tmp_path))
    saved = worker.state_dict()
    rng_then = worker.torch.get_rng_state().clone()
    worker.train_step(samples, tokens, count)
    continued = worker.state_dict()
    # A fresh worker (fresh optimizer) loads the checkpoint and takes the same second step.
    fresh = worker_factory()
    fresh.torch.manual_seed(12345)
    assert fresh.load_checkpoint(str(tmp_path), version=1) == 1
    assert fresh.torch.equal(fresh.torch.get_rng_state(), rng_then)
    for name, array in fresh.state_dict().items():
        np.testing.assert_array_equal(array, saved[name])
    fresh.train_step(samples, tokens, count)
    for name, array in fresh.state_dict().items():  # Adam moments restored: the same update
        np.testing.assert_array_equal(array, continued[name], err_msg=name)
    assert fresh.version == 2
    with pytest.raises(ValueError, match="policy version 1"):
        worker_factory().load_checkpoint(str(tmp_path), version=3)


def test_nonfinite_loss_is_skipped_or_stops_and_nan_weights_are_never_published(
    ray_cluster, worker_factory, tiny_model_path
):
    from operators.workers.engine_steps import NonFiniteError
    from pipelines.runtime.policy_store import create_policy_store

    samples = explode(step_samples(tiny_model_path))
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"])
    # 1e308 is a finite reward-scale number in float64 and inf once cast to float32 for the loss.
    poisoned = {**samples, "advantages": [1e308, *samples["advantages"][1:]]}
    store = create_policy_store("nan-test-store")
    worker = worker_factory(store=store)
    before = worker.state_dict()
    result = worker.train_step(poisoned, tokens, count)
    assert result["nonfinite_skipped"] == 1 and worker.version == 1
    for name, array in worker.state_dict().items():  # skipped: not one weight moved
        np.testing.assert_array_equal(array, before[name])
    assert store.version() == 1  # the unchanged weights, as version 1
    result = worker.train_step(samples, tokens, count)  # the next finite step trains normally
    assert result["nonfinite_skipped"] == 0 and worker.version == 2
    assert any(not np.array_equal(a, before[n]) for n, a in worker.state_dict().items())

    stopper = worker_factory(**{"train.nan_policy": "stop"})
    kept = stopper.state_dict()
    with pytest.raises(NonFiniteError, match="train.nan_policy: stop"):
        stopper.train_step({**samples, "advantages": [float("nan"), *samples["advantages"][1:]]}, tokens, count)
    for name, array in stopper.state_dict().items():
        np.testing.assert_array_equal(array, kept[name])

    # Weights that went non-finite anyway are refused at the door of the policy store.
    with worker.torch.no_grad():
        next(worker.engine.module.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="not published"):
        worker._publish()
    assert store.version() == 2
    store.kill()


def test_resume_refuses_a_different_config_or_dataset(tmp_path):
    from pipelines.data.datasets import load_prompts
    from pipelines.dag import schedule_groups

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["train.steps=4", "data.num_prompts=64",
                                                             f"output_dir={tmp_path}"])
    prompts, _ = load_prompts(cfg.data)
    schedule = schedule_groups(prompts, cfg)
    store = CheckpointDir.of_run(tmp_path, "run-a")
    store.write_run_file(run_file_info(cfg, "run-a", "digest-1", 1.0))
    assert resolve_run(tmp_path, "latest") == "run-a" and resolve_run(tmp_path, "run-a") == "run-a"
    with pytest.raises(ConfigError, match="--resume: run 'nope'"):
        resolve_run(tmp_path, "nope")
    ledger = pd.concat(schedule, ignore_index=True).query("train_step < 2").assign(
        policy_version=lambda t: t["train_step"], staleness=0, trained=True)
    tmp = store.begin(2)
    checkpoint_path = store.commit(tmp, 2, {"policy_version": 2}, ledger)
    checkpoint = store.latest_valid()
    assert checkpoint.path == checkpoint_path
    check_can_resume(cfg, store, checkpoint, schedule, "digest-1")  # the same job: fine
    # More steps, other resources and tracking may change; what is learned may not.
    longer = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["train.steps=10", "data.num_prompts=64",
                                                                "rollout.num_actors=2", f"output_dir={tmp_path}"])
    assert config_changes(run_file_info(cfg, "a", "d", 0)["config"], longer) == []
    changed = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["train.steps=4", "data.num_prompts=64",
                                                                 "train.lr=0.5", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        check_can_resume(changed, store, checkpoint, schedule, "digest-2")
    fields = [path for path, _ in err.value.problems]
    assert fields == ["train.lr", "data.path"], err.value
    reshuffled = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["train.steps=4", "data.num_prompts=64",
                                                                    "data.seed=1", f"output_dir={tmp_path}"])
    prompts_1, _ = load_prompts(reshuffled.data)
    with pytest.raises(ConfigError, match="ledger"):
        check_can_resume(cfg, store, checkpoint, schedule_groups(prompts_1.iloc[::-1], cfg), "digest-1")
    # A finished run (its last checkpoint at train.steps) is refused: there is nothing to resume.
    done = load_config(ROOT / "configs" / "tiny_grpo.yaml", ["train.steps=2", "data.num_prompts=64",
                                                              f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        check_can_resume(done, store, checkpoint, schedule, "digest-1")
    (field, message), = [p for p in err.value.problems if p[0] == "--resume"]
    assert "is finished" in message and "raise train.steps" in message


def test_process_deaths_are_told_apart_from_bugs():
    import ray.exceptions

    from operators.workers.engine_steps import NonFiniteError

    assert is_process_death(ray.exceptions.ActorDiedError())
    try:
        try:
            raise ray.exceptions.ActorDiedError()
        except Exception as inner:
            raise RuntimeError("map_batches(Train) failed") from inner
    except RuntimeError as outer:
        assert is_process_death(outer)
    # a surviving rank's all_reduce when its peer's node is gone (gloo's words, measured in test_node_loss)
    assert is_process_death(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                         "[127.0.0.1]:22447. This is typically caused by a remote worker crashing."))
    # the same when the peer's node went mid-read (seen in benchmarks/chaos.py)
    assert is_process_death(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read "
                                         "error [127.0.0.1]:41138: Connection reset by peer."))
    assert not is_process_death(ConnectionResetError("Connection reset by peer"))  # not a collective's
    assert not is_process_death(ValueError("a bug"))
    assert not is_process_death(NonFiniteError("loss is nan"))


def test_lineage_command_lists_what_made_a_checkpoint(tmp_path):
    store = CheckpointDir(tmp_path / "checkpoints" / "run-x")
    store.write_run_file({"run_id": "run-x", "started_at": 1.0, "config": {}, "dataset_digest": "d"})
    path = write_checkpoint(store, 3)
    cli = [sys.executable, "-m", "pipelines.cli", "lineage"]
    out = subprocess.run(cli + ["run-x", "--output-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "step 3" in out.stdout and "steps 1-3: 3 groups, 3 distinct prompt ids" in out.stdout
    out = subprocess.run(cli + ["--checkpoint", str(path), "--step", "2", "--json"], capture_output=True,
                         text=True, cwd=ROOT)
    info = json.loads(out.stdout)
    assert [row["prompt_id"] for row in info["ledger"]] == ["p1"] and info["step"] == 3
    out = subprocess.run(cli + ["--checkpoint", str(path), "--step", "5"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "step 5 is not in checkpoint" in out.stderr
    out = subprocess.run(cli + ["nope", "--output-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "run-x" in out.stderr


def test_resume_of_a_run_mlflow_does_not_know_is_refused_before_anything_starts(tmp_path):
    from pipelines.recovery.checkpoint import dataset_digest
    from pipelines.data.datasets import load_prompts
    from pipelines.job import run_job

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"output_dir={tmp_path}"])
    prompts, _ = load_prompts(cfg.data)
    CheckpointDir.of_run(tmp_path, "local-abc").write_run_file(
        run_file_info(cfg, "local-abc", dataset_digest(prompts), 1.0))
    with pytest.raises(ConfigError, match="cannot reopen MLflow run local-abc"):
        run_job(cfg, resume="latest")
