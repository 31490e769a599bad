"""`streamrl submit` refuses fast, with exit code 2 and a message naming the fix, and starts
nothing, when nothing (or not Ray) listens at the address or the config is invalid.
(Refusals that need a live cluster are in test_cluster.py.)"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines.runtime.submit import SubmitError, check_job_server, normalise_address, submit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_grpo.yaml"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the socket is: nothing listens there


def run_submit(cwd: Path, address: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "pipelines.cli", "submit", str(CONFIG), "--address", address, "--working-dir", str(ROOT)]
    args += [part for item in overrides for part in ("--set", item)]
    ray_tmp = cwd / "ray_tmp"
    ray_tmp.mkdir()
    started = time.monotonic()
    # RAY_TMPDIR: had anything started Ray, its session folder would appear here.
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "RAY_TMPDIR": str(ray_tmp)})
    return done, time.monotonic() - started


def assert_started_nothing(cwd: Path) -> None:
    assert list((cwd / "ray_tmp").iterdir()) == []  # no Ray session
    assert sorted(p.name for p in cwd.iterdir()) == ["ray_tmp"]  # no runs/, no mlflow.db


def test_nothing_listening_exits_2_and_starts_nothing(tmp_path):
    port = closed_port()
    done, seconds = run_submit(tmp_path, f"http://127.0.0.1:{port}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"nothing answers at http://127.0.0.1:{port}" in done.stderr and "ray start --head" in done.stderr
    assert "job" not in done.stdout  # no job id printed
    assert seconds < 90  # most of it is config validation importing torch, slow on a loaded 2-core machine
    assert_started_nothing(tmp_path)


def test_bad_config_and_bad_address_are_reported_together(tmp_path):
    done, _ = run_submit(tmp_path, f"127.0.0.1:{closed_port()}", "train.lr=-1", "rollout.n=0")
    assert done.returncode == 2
    for text in ("nothing answers at http://127.0.0.1:", "train.lr:", "rollout.n:"):
        assert text in done.stderr, done.stderr
    assert_started_nothing(tmp_path)


class NotRay(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_server_that_is_not_ray_is_named(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), NotRay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        done, _ = run_submit(tmp_path, address)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2
    assert f"{address} answers HTTP 404 but is not a Ray job server" in done.stderr
    assert_started_nothing(tmp_path)


def test_python_api_raises_before_starting_anything():
    import ray

    ray_was_up = ray.is_initialized()  # another module's fixture may have started Ray in this process
    started = time.monotonic()
    with pytest.raises(SubmitError, match="nothing answers"):
        check_job_server(f"http://127.0.0.1:{closed_port()}")
    assert time.monotonic() - started < 5  # a refused connection is not retried or waited on

    with pytest.raises(SubmitError, match="nothing answers"):
        submit(CONFIG, f"http://127.0.0.1:{closed_port()}", working_dir=ROOT)
    with pytest.raises(SubmitError, match="(?s)nothing answers.*train.steps"):  # both problems, one error
        submit(CONFIG, f"http://127.0.0.1:{closed_port()}", ["train.steps=0"], working_dir=ROOT)
    assert ray.is_initialized() == ray_was_up


@pytest.mark.parametrize("address, message", [
    ("ray://127.0.0.1:10001", "is a Ray Client address"),
    ("ftp://127.0.0.1:8265", "is not an http(s) address"),
    ("", "give the Ray job server"),
])
def test_wrong_kind_of_address(address, message):
    with pytest.raises(SubmitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        normalise_address(address)


def test_config_outside_the_working_dir_is_refused(tmp_path):
    from pipelines.runtime.submit import job_spec

    with pytest.raises(SubmitError, match="must lie inside the uploaded working directory"):
        job_spec(CONFIG, [], tmp_path)
    entrypoint, runtime_env = job_spec(CONFIG, ["rollout.resources={a: 1}"], ROOT)
    assert entrypoint == "python -m pipelines.cli run configs/tiny_grpo.yaml --set 'rollout.resources={a: 1}'"
    assert {".venv", "runs", ".git"} <= set(runtime_env["excludes"])
    assert runtime_env["working_dir"] == str(ROOT)
