"""Scale-out, for real: a two-node Ray cluster and an MLflow server, both on 127.0.0.1.

The head and a second node are real `ray start` processes (each its own raylet; the second
one carries a custom `rollout_node` resource); MLflow is a real `mlflow server`. The tiny
job goes in with `streamrl submit`, as a user would, and the test checks what lands in the
server and where each actor ran: generate on the second node only, the two DeepSpeed ranks
on both nodes.

Every server runs in its own session (setsid) on fresh ports, under its own temp folder;
teardown kills each session's processes, also when a test fails, and never touches another
Ray cluster on the machine (no `ray stop`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from benchmarks.real_servers import BIN, Sessions, free_port, http_ok, session_members, start_two_node_cluster, wait_until

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(servers):
    """Head (2 CPUs) + second node (2 CPUs, resource rollout_node), job server on loopback."""
    return start_two_node_cluster(servers, head_cpus=2, node_cpus=2, node_resources={"rollout_node": 2})


@pytest.fixture(scope="module")
def mlflow_server(servers):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    servers.start_until_ready("mlflow", [
        str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{servers.folder / 'mlflow.db'}",
        "--artifacts-destination", str(servers.folder / "mlflow-artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, lambda: http_ok(f"{uri}/health"), 120, attempts=1)
    return uri


def streamrl_submit(address: str, *overrides: str, timeout_s: float = 720) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pipelines.cli", "submit", "configs/tiny_grpo.yaml", "--address", address]
    args += [part for item in overrides for part in ("--set", item)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)


def jobs_on(address: str) -> list:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address).list_jobs()


def test_job_server_and_mlflow_listen_on_loopback_only(cluster, mlflow_server):
    """Reachable on 127.0.0.1, refused on the machine's own network address."""
    if cluster["node_ip"].startswith("127."):
        pytest.skip("this machine has no address but loopback to try from")
    for url in (cluster["address"], mlflow_server):
        port = int(url.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((cluster["node_ip"], port), timeout=5)


def test_bad_config_or_unplaceable_job_starts_nothing(cluster, mlflow_server):
    bad = streamrl_submit(cluster["address"], "train.lr=-1", "rollout.num_actors=0")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "train.lr" in bad.stderr and "rollout.num_actors" in bad.stderr
    # Valid, but asks for a GPU that no node has: it would wait forever, so it is refused.
    unplaceable = streamrl_submit(cluster["address"], "rollout.num_gpus=1")
    assert unplaceable.returncode == 2, unplaceable.stdout + unplaceable.stderr
    assert "does not fit the cluster" in unplaceable.stderr and "generate needs 1 x {CPU: 0.5, GPU: 1}" in unplaceable.stderr
    # A tracking server that is down is found before the job is sent.
    down = streamrl_submit(cluster["address"], f"tracking.uri=http://127.0.0.1:{free_port()}")
    assert down.returncode == 2 and "tracking.uri: nothing answers at" in down.stderr, down.stderr
    assert jobs_on(cluster["address"]) == []


# make test-extended (83 s): CI keeps `streamrl submit` to a two-node cluster (test_node_loss.py) and a job
# tracking to a real MLflow server (test_tracking_outage.py)
@pytest.mark.extended
def test_submitted_job_trains_across_nodes_and_tracks_to_server(cluster, mlflow_server, tmp_path, monkeypatch):
    started = time.monotonic()
    done = streamrl_submit(
        cluster["address"],
        f"train.steps={STEPS}", "train.groups_per_step=4", "rollout.n=4", "rollout.groups_per_call=2",
        "data.num_prompts=32", "train.world_size=2", "train.placement=STRICT_SPREAD",
        "rollout.resources={rollout_node: 1}", f"tracking.uri={mlflow_server}", "tracking.experiment=cluster",
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "SUCCEEDED" in output
    (job,) = jobs_on(cluster["address"])
    assert job.status == "SUCCEEDED" and job.submission_id in output
    assert ".venv" in job.runtime_env["excludes"] and "runs" in job.runtime_env["excludes"]
    run_line = next(line for line in output.splitlines() if line.startswith("streamrl submit: MLflow run "))
    run_id, url = run_line.split()[4:6]
    assert url.startswith(f"{mlflow_server}/#/experiments/") and url.endswith(run_id)
    print(f"submit -> SUCCEEDED in {time.monotonic() - started:.1f} s")

    # Read everything back through the server only, from a folder that has no local copy.
    monkeypatch.chdir(tmp_path)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.world_size"] == "2" and run.data.params["train.steps"] == str(STEPS)
    assert run.data.tags["code_version"] not in ("", "unknown")  # passed by submit; .git is not uploaded
    for metric in ("reward_mean", "success_rate", "policy_loss", "staleness_max", "time_train"):
        history = client.get_metric_history(run_id, metric)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), metric
    rollout_files = sorted(a.path for a in client.list_artifacts(run_id, "rollouts"))
    assert len(rollout_files) == STEPS, rollout_files
    groups = pd.concat([pd.read_parquet(client.download_artifacts(run_id, path, str(tmp_path))) for path in rollout_files])
    assert len(groups) == STEPS * 4 and groups["group_uid"].is_unique
    assert set(groups["train_step"]) == set(range(STEPS))
    checkpoint = run.data.tags["checkpoint.latest"]
    checkpoint_files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, checkpoint)}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= checkpoint_files
    assert not [name for name in checkpoint_files if name.endswith((".bin", ".pt", ".pth", ".pkl"))]  # no pickles
    local = Path(client.download_artifacts(run_id, f"{checkpoint}/config.json", str(tmp_path)))
    assert json.loads(local.read_text())["model_type"] == "llama"

    # Two ranks, one on each node (STRICT_SPREAD); rank 0 beside the driver, on the head.
    ranks = {run.data.tags[f"trainer.rank{rank}.node_id"] for rank in (0, 1)}
    assert ranks == {cluster["head"], cluster["second"]}
    assert run.data.tags["trainer.rank0.node_id"] == cluster["head"]
    from ray.util.state import list_actors

    actors = list_actors(address=cluster["address"], limit=1000, detail=True)
    generate_nodes = {actor.node_id for actor in actors if "Generate" in actor.class_name}
    trainer_nodes = {actor.node_id for actor in actors if actor.class_name == "TrainWorker"}
    assert generate_nodes == {cluster["second"]}  # only the second node has rollout_node
    assert trainer_nodes == {cluster["head"], cluster["second"]}


def test_teardown_kills_a_server_and_everything_it_started(tmp_path):
    """What the fixtures rely on, also after a failed test: a session's whole process tree
    goes, including children that outlive their parent, and nothing outside it."""
    sessions = Sessions(tmp_path)
    outsider = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        leader = sessions.start("tree", ["bash", "-c", "(sleep 300 &) ; trap '' TERM; sleep 300; true"])
        wait_until(lambda: len(session_members(leader.pid)) >= 2, 30, "process tree", sessions, "tree")
        sessions.stop()  # the leader and one sleep ignore SIGTERM: SIGKILL must follow
        assert session_members(leader.pid) == []
        assert outsider.poll() is None  # another session is left alone
    finally:
        outsider.kill()
        outsider.wait()


def test_trainer_group_that_cannot_be_placed_fails_and_frees_its_reservation(ray_cluster):
    """STRICT_SPREAD over 2 ranks on the one-node session cluster: no rank is started (ranks are
    created only once the whole group is reserved), a timeout names the field, and no bundle
    stays reserved."""
    from pipelines.config.load import load_config
    from pipelines.runtime.trainer_group import start_trainer_group

    cfg = load_config(None, ["rollout.n=4", "train.world_size=2", "train.placement=STRICT_SPREAD",
                             "train.placement_timeout_s=2"])
    free_before = ray_cluster.available_resources()["CPU"]
    with pytest.raises(TimeoutError, match="train.placement: the cluster found no room for 2 trainer rank"):
        start_trainer_group(cfg, "never-loaded", None)
    assert [group["state"] for group in ray_cluster.util.placement_group_table().values()] in ([], ["REMOVED"])
    wait_until_free = time.monotonic() + 10
    while ray_cluster.available_resources()["CPU"] < free_before and time.monotonic() < wait_until_free:
        time.sleep(0.2)
    assert ray_cluster.available_resources()["CPU"] == free_before
