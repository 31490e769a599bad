"""Submit a job to a running Ray cluster: the same config that runs locally, plus an address.

    streamrl submit configs/tiny_grpo.yaml --address http://127.0.0.1:8265 --set tracking.uri=http://...

What happens, in order (everything before step 4 runs on the submitting machine and starts
nothing, so a mistake costs seconds, exit code 2):

1. the config is validated with the `--set` overrides, exactly as `streamrl run` would;
2. the Ray job server at `address` (the dashboard port of the head, 8265 by default) and a
   tracking server named by `tracking.uri` must answer;
3. the job's actors and trainer placement must fit the live cluster's nodes;
4. the working directory is uploaded (minus `.venv`, `runs/`, `.git` and other build
   output, see EXCLUDES) and the job runs `python -m pipelines.cli run CONFIG --set ...` in
   it, on the head node; its Ray calls join the cluster the job runs in;
5. the job's status and logs are followed until it ends; the MLflow run id and URL are
   printed as soon as the job announces them.

The job's `python` is the first on the PATH of the `ray start` that started the head: start
Ray from the environment streamrl is installed in (an activated venv, or the image).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import load_config
from pipelines.tracking.run_inputs import CODE_VERSION_ENV
from pipelines.tracking.tracker import RUN_ANNOUNCEMENT

# Never uploaded with the working directory: environments, run output, caches, git objects.
EXCLUDES = [
    ".venv", "venv", ".git", "runs", "mlruns", "mlartifacts", "*.db", "__pycache__", ".pytest_cache",
    "*.egg-info", "build", "dist",
]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PROBE_TIMEOUT_S = 5.0


class SubmitError(Exception):
    """The job was not submitted and nothing was started (exit code 2)."""


@dataclass
class SubmittedJob:
    job_id: str
    address: str
    status: str = "PENDING"
    message: str = ""
    run_id: str | None = None
    run_url: str | None = None
    logs: str = ""


def normalise_address(address: str | None) -> str:
    """The job server's HTTP address: 'http://HEAD:8265' ('HEAD:8265' gets http://)."""
    if not address:
        raise SubmitError("--address: give the Ray job server, e.g. --address http://127.0.0.1:8265")
    if address.startswith("ray://"):
        raise SubmitError(
            f"--address: {address} is a Ray Client address; jobs are submitted to the job server on the "
            "dashboard port, e.g. http://HEAD:8265"
        )
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise SubmitError(f"--address: {address} is not an http(s) address; use e.g. http://127.0.0.1:8265")
    return address.rstrip("/")


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=PROBE_TIMEOUT_S) as response:
        return response.read()


def _ray_auth_headers() -> dict[str, str]:
    """The Authorization header Ray's JobSubmissionClient sends: the token when RAY_AUTH_MODE=token."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    return get_auth_headers_if_auth_enabled({})


def _reason(err: Exception) -> str:
    reason = getattr(err, "reason", None) or err
    return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason


def check_job_server(address: str) -> str:
    """Ray's version at `address`, or SubmitError saying what answers there instead."""
    try:
        body = _get(f"{address}/api/version", _ray_auth_headers())
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise SubmitError(
                f"--address: the job server at {address} requires Ray's token (HTTP {err.code}): set "
                "RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN, in a file named by "
                "RAY_AUTH_TOKEN_PATH or in ~/.ray/auth_token"
            ) from None
        raise SubmitError(
            f"--address: {address} answers HTTP {err.code} but is not a Ray job server; give the head's dashboard "
            "port (8265 by default); the head needs ray[default] installed for its job server"
        ) from None
    except (urllib.error.URLError, OSError) as err:
        raise SubmitError(
            f"--address: nothing answers at {address} ({_reason(err)}). Start a head with "
            "`ray start --head --dashboard-host 127.0.0.1` (the job server listens on its dashboard port, 8265 by "
            "default, and needs ray[default]) or fix --address"
        ) from None
    try:
        return json.loads(body)["ray_version"]
    except (ValueError, KeyError, TypeError):
        raise SubmitError(f"--address: {address}/api/version did not answer like a Ray job server") from None


def check_tracking_server(cfg: JobConfig) -> None:
    """A tracking server named in the config must answer before a job is started against it."""
    uri = cfg.tracking.uri
    if not cfg.tracking.enabled or not uri or not uri.startswith(("http://", "https://")):
        return
    try:
        _get(f"{uri.rstrip('/')}/health")
    except (urllib.error.URLError, OSError) as err:
        raise SubmitError(
            f"tracking.uri: nothing answers at {uri} ({_reason(err)}); start the MLflow server (docs/deploy.md) "
            "or fix tracking.uri"
        ) from None


def check_fits_cluster(cfg: JobConfig, address: str) -> None:
    """The job's actors must fit the live cluster, or it would wait for resources forever."""
    from ray.util.state import list_nodes

    from pipelines.runtime.resources import live_nodes, plan_problems

    nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], timeout=int(PROBE_TIMEOUT_S) * 2)
    problems = plan_problems(cfg, live_nodes({node.node_id: node.resources_total for node in nodes}))
    if problems:
        raise SubmitError(
            f"the job does not fit the cluster at {address}:\n" + "\n".join(f"  - {text}" for text in problems)
            + "\n(pass --skip-cluster-checks if an autoscaler will add the nodes)"
        )


def _code_version(working_dir: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=working_dir,
            capture_output=True, text=True, timeout=5, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def job_spec(config: str | Path, overrides: Sequence[str], working_dir: Path) -> tuple[str, dict]:
    """The entrypoint and runtime environment of the job."""
    config_file = Path(config).resolve()
    try:
        relative = config_file.relative_to(working_dir)
    except ValueError:
        raise SubmitError(
            f"{config}: the config must lie inside the uploaded working directory {working_dir}; move it there "
            "or pass --working-dir"
        ) from None
    entrypoint = shlex.join(
        ["python", "-m", "pipelines.cli", "run", relative.as_posix()]
        + [part for item in overrides for part in ("--set", item)]
    )
    env_vars = {"PYTHONUNBUFFERED": "1"}  # stream the job's lines as they are printed
    code_version = _code_version(working_dir)
    if code_version:
        env_vars[CODE_VERSION_ENV] = code_version
    runtime_env = {"working_dir": str(working_dir), "excludes": list(EXCLUDES), "env_vars": env_vars}
    return entrypoint, runtime_env


def submit(
    config: str | Path,
    address: str,
    overrides: Sequence[str] = (),
    working_dir: str | Path = ".",
    wait: bool = True,
    echo: Callable[[str], None] = print,
    check_cluster: bool = True,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> SubmittedJob:
    """Validate, check the servers, submit, and (with `wait`) follow the job to its end.

    Raises `ConfigError` (bad config) or `SubmitError` (bad address, server down, does not
    fit) before anything is started. `check_cluster=False` skips the MLflow and resource
    checks (a tracking server only the cluster reaches; an autoscaler that adds nodes)."""
    overrides = list(overrides)
    working_dir = Path(working_dir).resolve()
    problems: list[Exception] = []
    try:  # the cheap network check first, then the config: report both at once
        address = normalise_address(address)
        ray_version = check_job_server(address)
    except SubmitError as err:
        problems.append(err)
    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        problems.append(err)
    if problems:
        raise problems[0] if len(problems) == 1 else SubmitError("\n".join(map(str, problems)))
    if not working_dir.is_dir():
        raise SubmitError(f"--working-dir: {working_dir} is not a folder")
    entrypoint, runtime_env = job_spec(config, overrides, working_dir)
    if check_cluster:
        check_tracking_server(cfg)
        check_fits_cluster(cfg, address)
    if cfg.tracking.enabled and cfg.tracking.uri is None:
        echo("streamrl submit: warning: tracking.uri is not set, so the run is recorded in a sqlite file inside the "
             "job's temporary working directory on the cluster; set tracking.uri to a shared MLflow server")

    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(address)
    job_id = client.submit_job(
        entrypoint=entrypoint, runtime_env=runtime_env, metadata={"streamrl.config": str(config)}
    )
    echo(f"streamrl submit: job {job_id} submitted to {address} (Ray {ray_version}): {entrypoint}")
    job = SubmittedJob(job_id, address)
    if wait:
        follow(client, job, echo, poll_s, timeout_s)
    return job


def follow(client, job: SubmittedJob, echo: Callable[[str], None], poll_s: float = 1.0,
           timeout_s: float | None = None) -> SubmittedJob:
    """Print the job's new log lines and status changes until it ends (or `timeout_s`)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    printed, last_status = 0, None
    try:
        while True:
            status = str(client.get_job_status(job.job_id).value)
            job.logs = client.get_job_logs(job.job_id)
            for line in job.logs[printed:].splitlines():
                echo(line)
            printed = len(job.logs)
            if job.run_id is None and (found := RUN_ANNOUNCEMENT.search(job.logs)):
                job.run_id, job.run_url = found["run_id"], found["url"]
                echo(f"streamrl submit: MLflow run {job.run_id} {job.run_url}")
            if status != last_status:
                echo(f"streamrl submit: job {job.job_id} {status}")
                job.status = last_status = status
            if status in TERMINAL:
                job.message = client.get_job_info(job.job_id).message or ""
                if status != "SUCCEEDED" and job.message:
                    echo(f"streamrl submit: {job.message}")
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job.job_id} still {status} after {timeout_s:g} s")
            time.sleep(poll_s)
    except KeyboardInterrupt:
        echo(f"streamrl submit: stopped following; job {job.job_id} keeps running. Stop it with "
             f"`ray job stop --address {job.address} {job.job_id}`")
        raise
