"""What a local cluster started by streamrl (pipelines.runtime.session.init_ray) listens on, and whether it asks for a token.

The cluster runs in a child process of its own: a clean environment (no RAY_ADDRESS, no token, an empty
HOME so no ~/.ray/auth_token), and no clash with the session's cluster (conftest.ray_cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# Starts the cluster as `streamrl run` does (dashboard on, to check it too), makes Ray start workers and
# an actor, then reports every listening TCP socket of the driver and the processes it started.
SCRIPT = r"""
import json, os, urllib.error, urllib.request
import psutil, ray
from pipelines.runtime.session import init_ray
from pipelines.runtime.submit import check_job_server

init_ray(num_cpus=2, object_store_memory_mb=200, include_dashboard=True, dashboard_host="127.0.0.1")

@ray.remote(num_cpus=0.5)
def pid():
    return os.getpid()

@ray.remote(num_cpus=0.5)
class Probe:
    def pid(self):
        return os.getpid()

actor = Probe.remote()
ray.get([pid.remote() for _ in range(2)] + [actor.pid.remote()])

def status(url, headers):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code

jobs = "http://" + ray._private.worker.get_dashboard_url() + "/api/jobs/"  # init_ray returns no context
me = psutil.Process()
listening = []
for process in [me, *me.children(recursive=True)]:
    try:
        sockets = [c for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        # the whole command line: a cut at a fixed width dropped the script's name when the checkout's path was long
        name = " ".join([process.name(), *process.cmdline()])
    except psutil.NoSuchProcess:
        continue
    listening += [{"pid": process.pid, "process": name, "ip": c.laddr.ip, "port": c.laddr.port} for c in sockets]
print(json.dumps({
    "listening": listening,
    "node_ip": ray.util.get_node_ip_address(),
    "auth_mode": os.environ.get("RAY_AUTH_MODE"),
    "jobs_without_token": status(jobs, {}),
    "jobs_with_token": status(jobs, {"Authorization": "Bearer " + os.environ.get("RAY_AUTH_TOKEN", "")}),
    "submit_probe": check_job_server(jobs.removesuffix("/api/jobs/")),  # streamrl submit's probe sends the token
}))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("home")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["home"] = home
    return report


@pytest.mark.slow
def test_local_cluster_listens_on_loopback_only(local_cluster):
    """No process of the session listens on 0.0.0.0, :: or the machine's address: GCS, raylet (node manager
    and object manager), the driver's and the workers' gRPC servers, dashboard, agents, metrics."""
    listening = local_cluster["listening"]
    exposed = [entry for entry in listening if entry["ip"] not in LOOPBACK]
    assert not exposed, json.dumps(exposed, indent=1)
    assert local_cluster["node_ip"] == "127.0.0.1"
    # Not vacuous: the components that listened on every interface before are there, on loopback.
    processes = " | ".join(entry["process"] for entry in listening)
    for component in ("gcs_server", "raylet", "ray::Probe", "dashboard", "ray::DashboardAgent"):
        assert component in processes, processes


@pytest.mark.slow
def test_local_cluster_requires_its_token(local_cluster):
    """Token auth is on (a loopback port is still reachable by every user of the machine), with a token of
    this process's own: nothing was written to ~/.ray."""
    assert local_cluster["auth_mode"] == "token"
    assert local_cluster["jobs_without_token"] == 401
    assert local_cluster["jobs_with_token"] == 200
    assert local_cluster["submit_probe"] == "2.60.0"
    assert not (local_cluster["home"] / ".ray").exists()
