"""The MLflow tracking server goes away mid-job: training continues and no record is lost.

Against a real `mlflow server` that is killed (SIGKILL to its whole process tree) and started
again on the same port and store:
- a tracker's writes return at once while the server is down, are delivered once it is back,
  with the time of the original call, and say so on the terminal;
- a process that dies with records undelivered leaves them in its spool; resuming the run
  delivers them once each, without re-logging params or the dataset input;
- a real job keeps training through a 12 s outage and its run ends complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from benchmarks.real_servers import MlflowServer, Sessions
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.tracking.tracker import NullTracker, Tracker

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("reward_mean", "success_rate", "policy_loss", "staleness_max")
HTTP_ENV = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
OUTAGE_S = 12  # the job test: how long the server stays dead before it is started again
UNREACHABLE = re.compile(r"^streamrl: MLflow unreachable \((?P<why>[^)]*)\); buffering records in (?P<spool>\S+); "
                         r"training continues$", re.MULTILINE)
REACHABLE = re.compile(r"^streamrl: MLflow reachable again; delivered (?P<count>\d+) buffered records$", re.MULTILINE)


@pytest.fixture(autouse=True)
def mlflow_http_env():
    """The Tracker sets MLflow's HTTP retry/timeout variables for its process; undo that after each test."""
    saved = {name: os.environ.get(name) for name in HTTP_ENV}
    for name in HTTP_ENV:
        os.environ.pop(name, None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def server_process():
    """One server for the module (a start takes 5-30 s on a busy 2-core machine); each test uses its own run."""
    folder = Path(tempfile.mkdtemp(prefix="srl-mlf-", dir="/tmp"))
    sessions = Sessions(folder)
    mlflow_server = MlflowServer(sessions)
    try:
        mlflow_server.start()
        yield mlflow_server
    finally:
        try:
            sessions.stop()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def server(server_process):
    if server_process.current is None:  # a failed test left it stopped
        server_process.start()
    return server_process


def tracker_overrides(output_dir: Path, uri: str, **extra) -> list[str]:
    values = {"output_dir": str(output_dir), "tracking.uri": uri, "tracking.experiment": "outage",
              "data.num_prompts": 8, **extra}
    return [f"{key}={value}" for key, value in values.items()]


def step_row(step: int) -> dict:
    """A train step's row as the DAG yields it: metrics and the path of the step's rollouts Parquet, which
    the Train operator wrote."""
    path = Path(tempfile.mkdtemp(prefix="srl-rollouts-")) / f"step_{step:06d}.parquet"
    pd.DataFrame({"train_step": [step, step], "group_uid": [f"s{step}-g0", f"s{step}-g1"]}).to_parquet(path)
    return {"step": step, "reward_mean": 0.1 * step, "success_rate": 0.05 * step, "policy_loss": 1.0 - 0.1 * step,
            "staleness_max": step % 2, "rollouts_path": str(path)}


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:g} s")


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


def delivered_count(spool: Path) -> int:
    return int(spool.with_suffix(".delivered").read_text())


def test_writes_return_at_once_during_an_outage_and_arrive_later_with_their_own_time(server, tmp_path):
    cfg = load_config(None, tracker_overrides(tmp_path / "out", server.uri))
    prompts, source = load_prompts(cfg.data)
    lines: list[str] = []
    tracker = Tracker(cfg, prompts, source, echo=lines.append)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"  # not MLflow's ~4 minutes of retries
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == str(cfg.tracking.request_timeout_s)
    spool = tmp_path / "out" / "mlflow_spool" / f"{tracker.run_id}.jsonl"
    tracker.log_step(step_row(0))
    assert tracker.flush(30) and tracker.pending == 0

    server.stop()
    called_at = {}
    for step in range(1, 5):
        before, started = int(time.time() * 1000), time.monotonic()
        tracker.log_step(step_row(step))
        took = time.monotonic() - started
        assert took < 1.0, f"log_step blocked {took:.2f} s on a dead server"
        called_at[step] = (before, int(time.time() * 1000))
        time.sleep(0.3)
    checkpoint = tmp_path / "out" / "ckpt"
    (checkpoint / "engine").mkdir(parents=True)
    (checkpoint / "engine" / "optim_states.pt").write_bytes(b"x" * 1000)  # must stay local
    (checkpoint / "tokenizer").mkdir()
    (checkpoint / "tokenizer" / "vocab.json").write_text("{}")
    (checkpoint / "config.json").write_text("{}")
    started = time.monotonic()
    assert tracker.log_checkpoint(checkpoint, 4) == "checkpoints/step_000004"
    assert time.monotonic() - started < 1.0

    wait_for(lambda: UNREACHABLE.search("\n".join(lines)), 20, "the 'MLflow unreachable' line")
    (found,) = UNREACHABLE.finditer("\n".join(lines))  # one line per outage, not one per failed try
    assert found.group("spool") == str(spool) and found.group("why") == "Connection refused", found.group(0)
    # 4 steps x (metrics + rollouts) + checkpoint (config.json, tokenizer/) + its tags + its "uploaded" mark
    assert tracker.pending == 4 * 2 + 2 + 1 + 1
    assert len(spool.read_text().splitlines()) == 2 + tracker.pending and delivered_count(spool) == 2

    time.sleep(1.0)
    restarted_at = int(time.time() * 1000)
    server.start()
    assert tracker.flush(90), f"{tracker.pending} records still buffered after the server came back"
    assert tracker.pending == 0 and delivered_count(spool) == len(spool.read_text().splitlines())
    assert [int(m.group("count")) for m in REACHABLE.finditer("\n".join(lines))] == [12], lines
    tracker.close()

    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    for key in METRICS:
        history = {metric.step: metric for metric in client.get_metric_history(tracker.run_id, key)}
        assert metric_steps(client, tracker.run_id, key) == [0, 1, 2, 3, 4], key  # each step once
        for step, (before, after) in called_at.items():
            stamp = history[step].timestamp
            assert before <= stamp <= after < restarted_at, (key, step, before, stamp, after, restarted_at)
    assert len(client.list_artifacts(tracker.run_id, "rollouts")) == 5
    files = {a.path for a in client.list_artifacts(tracker.run_id, "checkpoints/step_000004")}
    assert files == {"checkpoints/step_000004/config.json", "checkpoints/step_000004/tokenizer"}, files
    assert [a.path for a in client.list_artifacts(tracker.run_id, "checkpoints/step_000004/tokenizer")] == [
        "checkpoints/step_000004/tokenizer/vocab.json"]
    assert run.data.tags["checkpoint.latest"] == "checkpoints/step_000004"
    assert run.data.tags["checkpoint.latest_step"] == "4"
    assert run.data.tags["checkpoint.latest_path"] == str(checkpoint.resolve())


def test_close_gives_up_at_the_deadline_without_raising_and_resume_delivers_the_rest(server, tmp_path):
    cfg = load_config(None, tracker_overrides(tmp_path / "out", server.uri, **{"tracking.flush_timeout_s": 2}))
    prompts, source = load_prompts(cfg.data)
    lines: list[str] = []
    tracker = Tracker(cfg, prompts, source, echo=lines.append)
    server.stop()
    tracker.log_step(step_row(0))
    started = time.monotonic()
    tracker.close("FINISHED")  # the server is still down: must return, not raise
    took = time.monotonic() - started
    assert took < 2 + 15, f"close took {took:.1f} s"  # the deadline, then one failed request to end the run
    spool = tmp_path / "out" / "mlflow_spool" / f"{tracker.run_id}.jsonl"
    (left,) = [line for line in lines if "still undelivered" in line]
    assert left.startswith("streamrl: 3 MLflow records still undelivered after ") and f"kept in {spool}" in left
    assert "the run's end (FINISHED) among them" in left
    assert left.endswith(f"`streamrl sync CONFIG {tracker.run_id}` will deliver them"), left
    assert tracker.pending == 3 and not spool.with_suffix(".delivered").exists()  # nothing was delivered

    server.start()
    client = MlflowClient(server.uri)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"  # it could not be ended
    assert metric_steps(client, tracker.run_id, "reward_mean") == []
    resumed = Tracker(cfg, prompts, source, resume_run_id=tracker.run_id, echo=lines.append)
    resumed.close("FINISHED")
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert metric_steps(client, tracker.run_id, "reward_mean") == [0]
    assert len(client.list_artifacts(tracker.run_id, "rollouts")) == 1


def test_a_job_that_ended_during_an_outage_is_delivered_by_streamrl_sync(server, tmp_path, capsys):
    """A finished run cannot be resumed, so `streamrl sync CONFIG RUN_ID` delivers what its job left in the
    spool, the run's end status last."""
    from pipelines.cli import main

    overrides = tracker_overrides(tmp_path / "out", server.uri, **{"tracking.flush_timeout_s": 1})
    cfg = load_config(None, overrides)
    prompts, source = load_prompts(cfg.data)
    tracker = Tracker(cfg, prompts, source, echo=lambda line: None)
    tracker.log_step(step_row(0))
    assert tracker.flush(30)
    server.stop()
    for step in (1, 2):
        tracker.log_step(step_row(step))
    tracker.close("FINISHED")  # 2 x (metrics + rollouts) and the run's end left in the spool
    from pipelines.recovery.checkpoint import CheckpointDir

    CheckpointDir.of_run(tmp_path / "out", tracker.run_id).write_run_file({"run_id": tracker.run_id, "sequence": 0})
    argv = ["sync", "configs/tiny_grpo.yaml", *[part for item in overrides for part in ("--set", item)], tracker.run_id]
    assert main(argv) == 2  # still down: said, nothing lost
    assert f"cannot read MLflow run {tracker.run_id} at {server.uri}" in capsys.readouterr().err

    server.start()
    client = MlflowClient(server.uri)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"streamrl: run {tracker.run_id}: delivering 5 records from " in out
    assert f"streamrl: run {tracker.run_id}: 5 records delivered" in out
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    for key in METRICS:
        assert metric_steps(client, tracker.run_id, key) == [0, 1, 2], key
    assert len(client.list_artifacts(tracker.run_id, "rollouts")) == 3
    spool = tmp_path / "out" / "mlflow_spool" / f"{tracker.run_id}.jsonl"
    assert delivered_count(spool) == len(spool.read_text().splitlines())
    assert main([*argv[:-1], "latest"]) == 0 and "nothing to deliver" in capsys.readouterr().out


def test_default_sqlite_store_goes_through_the_same_spool_and_writer(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path}", "data.num_prompts=8", "tracking.experiment=local"])
    prompts, source = load_prompts(cfg.data)
    lines: list[str] = []
    tracker = Tracker(cfg, prompts, source, echo=lines.append)
    assert not any(name in os.environ for name in HTTP_ENV)  # MLflow's HTTP settings only for a server
    for step in range(3):
        tracker.log_step(step_row(step))
    tracker.set_tags({"note": 1})
    # A checkpoint pruned by newer ones before the driver logged it: said, not uploaded, no error.
    tracker.log_checkpoint(tmp_path / "checkpoints" / "step_000002", 2)
    assert lines == [f"streamrl: checkpoint {tmp_path / 'checkpoints' / 'step_000002'} was pruned "
                     "(train.checkpoint_keep) before it was logged; not uploaded"]
    tracker.close()
    lines.remove(lines[0])
    assert lines == []  # nothing else to report
    client = MlflowClient(cfg.tracking_uri())
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["note"] == "1"
    assert metric_steps(client, tracker.run_id, "policy_loss") == [0, 1, 2]
    assert len(client.list_artifacts(tracker.run_id, "rollouts")) == 3
    spool = tmp_path / "mlflow_spool" / f"{tracker.run_id}.jsonl"
    # 3 x (metrics + rollouts), the tags, the run's end (delivered like any record)
    assert delivered_count(spool) == len(spool.read_text().splitlines()) == 8


def test_null_tracker_has_the_same_interface(tmp_path):
    tracker = NullTracker(None, None, None, resume_run_id="abc", echo=print)
    tracker.log_step(step_row(0))
    tracker.set_tags({"a": 1})
    tracker.log_artifact(tmp_path, "x")
    assert tracker.log_checkpoint(tmp_path, 3, exclude=()) == str(tmp_path)
    assert tracker.flush(1) and tracker.pending == 0 and not tracker.resumed and tracker.run_id is None
    tracker.close("FAILED")


CRASHING_JOB = """
import json, os, sys, time
sys.path[:0] = ["tests/e2e"]
from pipelines.config.load import load_config
from pipelines.data.datasets import load_prompts
from pipelines.tracking.tracker import NullTracker, Tracker
from test_tracking_outage import step_row

cfg = load_config(None, json.loads(sys.argv[1]))
prompts, source = load_prompts(cfg.data)
lines = []
tracker = Tracker(cfg, prompts, source, echo=lines.append)
tracker.log_step(step_row(0))
assert tracker.flush(60)
print(tracker.run_id, flush=True)
sys.stdin.readline()  # the test has stopped the server
for step in (1, 2, 3):
    tracker.log_step(step_row(step))
while not any("unreachable" in line for line in lines):  # the writer tried, and failed
    time.sleep(0.1)
print(tracker.pending, flush=True)
os._exit(3)  # a crash: no close, no flush, the writer thread dies mid-backoff
"""


def test_a_crashed_job_leaves_its_records_in_the_spool_and_resume_delivers_them(server, tmp_path):
    overrides = tracker_overrides(tmp_path / "out", server.uri)
    job = subprocess.Popen([sys.executable, "-c", CRASHING_JOB, json.dumps(overrides)], cwd=ROOT, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        run_id = job.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{32}", run_id), run_id + job.stderr.read()
        server.stop()
        job.stdin.write("go\n")
        job.stdin.flush()
        pending = int(job.stdout.readline() or -1)
        assert job.wait(60) == 3, job.stderr.read()
    finally:
        job.kill()
        job.wait()
    assert pending == 6  # steps 1-3, metrics + rollouts each
    spool = tmp_path / "out" / "mlflow_spool" / f"{run_id}.jsonl"
    records = [json.loads(line) for line in spool.read_text().splitlines()]
    assert len(records) == 8 and delivered_count(spool) == 2  # the undelivered tail is known
    assert [r["step"] for r in records if r["op"] == "metrics"] == [0, 1, 2, 3]

    server.start()
    client = MlflowClient(server.uri)
    assert metric_steps(client, run_id, "reward_mean") == [0]  # the dead process delivered nothing more
    before = client.get_run(run_id)
    # A resume with one changed setting: MLflow refuses a param logged again with another value.
    cfg = load_config(None, [*overrides, "train.lr=0.5"])
    prompts, source = load_prompts(cfg.data)
    lines: list[str] = []
    tracker = Tracker(cfg, prompts, source, resume_run_id=run_id, echo=lines.append)
    assert tracker.resumed and tracker.run_id == run_id
    assert f"streamrl: resuming MLflow run {run_id}; delivering 6 records left undelivered in {spool}" in lines
    assert tracker.flush(60) and tracker.pending == 0
    tracker.log_step(step_row(4))
    tracker.close()

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in METRICS:
        assert metric_steps(client, run_id, key) == [0, 1, 2, 3, 4], key  # each step exactly once
    replayed = {m.step: m.timestamp for m in client.get_metric_history(run_id, "reward_mean")}
    assert {r["step"]: r["timestamp"] for r in records if r["op"] == "metrics"}.items() <= replayed.items()
    assert len(client.list_artifacts(run_id, "rollouts")) == 5
    assert run.data.params == before.data.params  # nothing re-logged, the old lr kept
    assert run.data.params["train.lr"] != "0.5"
    assert run.data.tags["resume.count"] == "1" and run.data.tags["resume.changed_params"] == "train.lr"
    assert len(run.inputs.dataset_inputs) == 1  # same prompts: the dataset input is not repeated
    assert delivered_count(spool) == len(spool.read_text().splitlines()) == 11  # ... + step 4 + the run's end

    # A second resume, with the original settings: the counter goes on, nothing is reported changed.
    again = Tracker(load_config(None, overrides), prompts, source, resume_run_id=run_id, echo=lines.append)
    again.close()
    tags = client.get_run(run_id).data.tags
    assert tags["resume.count"] == "2" and "resume.changed_params" not in tags


@pytest.mark.slow
def test_job_keeps_training_through_a_tracking_server_outage(ray_cluster, server, tmp_path, capfd):
    steps = 8
    overrides = {
        "train.steps": steps, "train.groups_per_step": 4, "train.max_staleness": 1, "rollout.n": 4,
        "rollout.groups_per_call": 1, "rollout.num_actors": 2, "rollout.num_cpus": 0.25, "data.num_prompts": 32,
        "output_dir": str(tmp_path), "tracking.uri": server.uri, "tracking.experiment": "outage-job",
        "tracking.flush_timeout_s": 120,
        "train.checkpoint_every": 2,  # step metrics go out as checkpoints cover them: some during the outage
        "train.checkpoint_keep": 0,
    }
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    from pipelines.job import run_job

    lines: list[str] = []
    outage: dict = {}
    steps_while_down: list[int] = []
    restart_errors: list[BaseException] = []

    def restart_later():
        try:
            time.sleep(OUTAGE_S)
            outage["restart_s"] = server.start()
            outage["up"] = time.monotonic()
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            restart_errors.append(err)

    restarter = threading.Thread(target=restart_later, daemon=True)

    def echo(line: str) -> None:
        lines.append(line)
        progress = re.match(r"step\s+(\d+)/", line)
        if not progress:
            return
        step = int(progress.group(1))
        if step == 1 and "down" not in outage:
            server.stop()  # from the driver loop itself: the next steps run with MLflow dead
            outage["down"] = time.monotonic()
            restarter.start()
        elif "down" in outage and "up" not in outage:
            steps_while_down.append(step)

    started = time.monotonic()
    result = run_job(cfg, echo=echo)
    took = time.monotonic() - started
    restarter.join(120)
    assert not restart_errors, restart_errors
    printed = "\n".join(lines) + "\n" + capfd.readouterr().out  # the Tracker prints, until run_job passes echo
    after = [int(m.group(1)) for m in re.finditer(r"^step\s+(\d+)/", "\n".join(lines), re.MULTILINE)]
    print(f"job {took:.0f} s; MLflow down {outage['up'] - outage['down']:.1f} s (restart took "
          f"{outage['restart_s']:.1f} s); steps finished while down: {steps_while_down}, after: "
          f"{[step for step in after if step > max(steps_while_down + [1])]}")
    print("\n".join(line for line in printed.splitlines() if "MLflow" in line))
    assert steps_while_down, "no step finished while MLflow was down: lengthen OUTAGE_S"

    spool = tmp_path / "mlflow_spool" / f"{result.run_id}.jsonl"
    unreachable = UNREACHABLE.search(printed)
    assert unreachable and unreachable.group("spool") == str(spool), printed
    assert REACHABLE.search(printed), printed
    assert "still undelivered" not in printed, printed

    client = MlflowClient(server.uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    for key in METRICS:
        assert metric_steps(client, result.run_id, key) == list(range(1, steps + 1)), key
    assert len(client.list_artifacts(result.run_id, "rollouts")) == steps
    assert run.data.tags["checkpoint.latest"] == f"checkpoints/step_{steps:06d}"
    assert run.data.tags["checkpoint.latest_step"] == str(steps)
    assert run.data.tags["checkpoint.latest_path"] == str(result.checkpoint.resolve())
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(result.run_id, run.data.tags["checkpoint.latest"])}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    (output,) = run.outputs.model_outputs  # the final checkpoint as an MLflow model (tests/e2e/test_mlflow_model.py)
    model = client.get_logged_model(output.model_id)
    assert output.step == steps and model.status.name == "READY" and run.data.tags["model.latest_id"] == model.model_id
    assert model.params["streamrl.policy_version"] == str(steps)
    assert model.params["streamrl.checkpoint_path"] == str(result.checkpoint.resolve())
    assert delivered_count(spool) == len(spool.read_text().splitlines())
