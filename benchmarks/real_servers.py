"""Real servers for the tests and benchmarks/chaos.py: processes each in their own session (setsid), so
teardown kills a server's whole process tree and nothing else on the machine; a two-node Ray cluster of real
`ray start` processes (one session per node, so killing a session is losing that node); and an
`mlflow server` that can be killed and started again on the same port and store, as in an outage."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent  # the venv's bin: `ray`, `mlflow`, and the jobs' `python`
ROOT = Path(__file__).resolve().parents[1]


def submit_and_follow(address: str, sets: dict, on_line, timeout_s: float = 600) -> tuple[int, str]:
    """`streamrl submit configs/tiny_grpo.yaml` with `sets` to the cluster at `address`, in a session of its
    own; each line it prints is echoed and given to `on_line`. Returns its exit code and everything it printed.
    The read loop ends at EOF only, so a job that never ends is killed (its whole session) after `timeout_s`
    and the test fails with its log instead of hanging until pytest's timeout."""
    argv = [sys.executable, "-m", "pipelines.cli", "submit", "configs/tiny_grpo.yaml", "--address", address]
    argv += [part for key, value in sets.items() for part in ("--set", f"{key}={value}")]
    submit = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    watchdog = threading.Timer(timeout_s, lambda: os.killpg(submit.pid, signal.SIGKILL))
    watchdog.daemon = True
    watchdog.start()
    lines = []
    try:
        for line in submit.stdout:
            lines.append(line)
            print(line, end="", flush=True)
            on_line(line)
        code = submit.wait(timeout=300)
    finally:
        watchdog.cancel()
        if submit.poll() is None:
            submit.kill()
    return code, "".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`: the leader and everything it started."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry))
    return members


class Sessions:
    """Processes started each in a new session, all killed on `stop()`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder,
                env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})},
            )
        self.procs[name] = proc
        return proc

    def start_until_ready(self, name: str, argv: list[str], env: dict, ready, timeout_s: float, attempts: int = 3):
        """Start, wait for `ready()`; retry a process that died while starting. Ray gives a node
        a fixed 30 s to register, which a busy 2-core machine can miss."""
        for attempt in range(1, attempts + 1):
            self.start(f"{name}-{attempt}", argv, env)
            try:
                return wait_until(ready, timeout_s, name, self, f"{name}-{attempt}")
            except RuntimeError:  # exited early
                if attempt == attempts:
                    raise
                self.kill_session(f"{name}-{attempt}")

    def kill_session(self, name: str) -> None:
        for pid in session_members(self.procs[name].pid):
            with_suppressed(os.kill, pid, signal.SIGKILL)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]

    def members(self) -> list[int]:
        return [pid for proc in self.procs.values() for pid in session_members(proc.pid)]

    def stop(self) -> None:
        for sig, grace_s in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 8.0)):
            for pid in self.members():
                with_suppressed(os.kill, pid, sig)
            deadline = time.monotonic() + grace_s
            while self.members() and time.monotonic() < deadline:
                for proc in self.procs.values():
                    proc.poll()  # reap our direct children
                time.sleep(0.2)
            if not self.members():
                break
        left = self.members()
        assert not left, f"processes still running after SIGKILL: {left}"


def with_suppressed(fn, *args) -> None:
    try:
        fn(*args)
    except ProcessLookupError:
        pass


def wait_until(check, timeout_s: float, what: str, sessions: Sessions, name: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # not up yet
            result = check()
            if result:
                return result
        if sessions.procs[name].poll() is not None:
            raise RuntimeError(f"{name} exited ({sessions.procs[name].returncode}):\n{sessions.log(name)}")
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout_s:g} s:\n{sessions.log(name)}")


def start_head(sessions: Sessions, cpus: int, resources: dict[str, float] | None = None) -> dict:
    """A head node (`ray start --head --block` in a session of its own), the job server on loopback.
    Returns the job server's `address`, the `gcs` port nodes join on and the `head` node id."""
    gcs, dashboard = free_port(), free_port()
    argv = [
        str(BIN / "ray"), "start", "--head", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard), "--ray-client-server-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
        "--temp-dir", str(sessions.folder / "head"), "--num-cpus", str(cpus),
        "--resources", json.dumps(resources or {}), *_COMMON,
    ]
    address = f"http://127.0.0.1:{dashboard}"
    (head,) = sessions.start_until_ready("ray-head", argv, _ENV,
                                         lambda: http_ok(f"{address}/api/version") and _alive_nodes(address), 120)
    return {"address": address, "gcs": gcs, "head": head.node_id, "node_ip": head.node_ip}


def add_node(sessions: Sessions, cluster: dict, name: str, cpus: int, resources: dict[str, float] | None = None) -> dict:
    """Another node joins `cluster` (start_head's): a real `ray start --block` in a session of its own.
    Returns its `node_id` and `session` (`sessions.kill_session(session)` loses that node: raylet, object
    store and every worker it started)."""
    before = {node.node_id for node in _alive_nodes(cluster["address"])}
    argv = [
        str(BIN / "ray"), "start", "--address", f"127.0.0.1:{cluster['gcs']}", "--resources", json.dumps(resources or {}),
        "--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port()),
        # Its own temp dir, as on a separate machine: nodes sharing one would share the unpacked
        # working dir, and one node's runtime-env agent deletes it under the other's job driver.
        "--temp-dir", str(sessions.folder / name), "--num-cpus", str(cpus), *_COMMON,
    ]

    def joined():
        new = [node for node in _alive_nodes(cluster["address"]) if node.node_id not in before]
        return new or None

    (node,) = sessions.start_until_ready(f"ray-{name}", argv, _ENV, joined, 120)
    session = next(proc for proc in reversed(sessions.procs) if proc.startswith(f"ray-{name}-"))
    return {"node_id": node.node_id, "session": session}


def start_two_node_cluster(sessions: Sessions, head_cpus: int, node_cpus: int, node_resources: dict[str, float],
                           head_resources: dict[str, float] | None = None) -> dict:
    """A head and a second node (custom resources on each). Returns the job server's address, both node
    ids, the head's IP and the name of the second node's session (`sessions.kill_session(name)` loses
    that node)."""
    cluster = start_head(sessions, head_cpus, head_resources)
    node = add_node(sessions, cluster, "node2", node_cpus, node_resources)
    return {**cluster, "second": node["node_id"], "second_session": node["session"]}


def _alive_nodes(address: str) -> list:
    from ray.util.state import list_nodes

    # raise_on_missing_output=False: a dead node left in the table makes the state API call the answer truncated
    return list_nodes(address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)


_COMMON = ["--block", "--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]
# Several nodes on one machine need Ray's multi-node mode, which binds every interface: these test
# clusters are the exception to loopback-only, and run without token auth so that this process's clients
# (JobSubmissionClient, the state API, `streamrl submit`) need no token.
_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with a sqlite store and proxied artifacts under `sessions.folder`.

    `stop()` kills it outright (SIGKILL to its whole session, as a crash or a lost machine would);
    `start()` again brings it back on the same port with the same store and artifacts. One worker
    and no job runner: ~420 MB instead of ~1.7 GB."""

    def __init__(self, sessions: Sessions, name: str = "mlflow"):
        self.sessions = sessions
        self.name = name
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.starts = 0
        self.current: str | None = None

    def start(self, timeout_s: float = 120) -> float:
        """Start and wait until /health answers; returns the seconds it took."""
        began = time.monotonic()
        self.starts += 1
        name = f"{self.name}-{self.starts}"
        folder = self.sessions.folder
        self.sessions.start_until_ready(name, [
            str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{folder / f'{self.name}.db'}",
            "--artifacts-destination", str(folder / f"{self.name}-artifacts"),
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, lambda: http_ok(f"{self.uri}/health"), timeout_s,
            attempts=1)
        self.current = f"{name}-1"
        return time.monotonic() - began

    def stop(self, timeout_s: float = 30) -> None:
        """Kill every process of the running server and wait until the port is closed."""
        assert self.current is not None, "not started"
        proc = self.sessions.procs[self.current]
        self.sessions.kill_session(self.current)
        deadline = time.monotonic() + timeout_s
        while (session_members(proc.pid) or not port_closed(self.port)) and time.monotonic() < deadline:
            proc.poll()  # reap the leader
            time.sleep(0.1)
        assert port_closed(self.port), f"{self.uri} still answers after its processes were killed"
        self.current = None
