"""The job's Ray session: join a cluster or start a local one (loopback only, token auth), with the
environment every Ray worker gets; `ray_session` uses the caller's Ray if there is one, and
`check_object_store` refuses a session whose object stores cannot hold what goes through them."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import ray

from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.runtime.memory import local_object_store_mb, object_store_problem, shm_problem
from pipelines.runtime.quiet import spend_actor_restart_warning
from pipelines.runtime.resources import Node, demands

# Set in every Ray worker: quiet libraries, no hub access, CPU DeepSpeed unless a trainer rank has a GPU
# (trainer_group sets DS_ACCELERATOR per rank).
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM logs every engine's whole config at INFO (pages per engine on a real model); warnings still show
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
}


def init_ray(
    address: str | None = None, num_cpus: int | None = None, object_store_memory_mb: int = 512,
    include_dashboard: bool = False, dashboard_host: str = "127.0.0.1",
) -> None:
    """Join the cluster at `address`, or the one a submitted job runs in (Ray sets RAY_ADDRESS
    for job drivers); otherwise start a local one bound to 127.0.0.1 with token authentication,
    its dashboard (if any) on `dashboard_host`."""
    level = os.environ.get("STREAMRL_RAY_LOG_LEVEL", "warning")
    logging.getLogger("ray.data").setLevel(level.upper())  # Ray Data logs each dataset's progress at INFO
    if address is not None or os.environ.get("RAY_ADDRESS"):
        # The cluster's own RAY_AUTH_MODE and token (in this environment, or the job's) decide: forcing
        # `disabled` would fail against a cluster that enforces tokens, and is not ours to choose.
        ray.init(address=address, logging_level=level, runtime_env={"env_vars": WORKER_ENV})
        spend_actor_restart_warning()
        return
    # Ray 2.60 turns token auth on for a new local cluster unless RAY_AUTH_MODE says otherwise; it
    # guards the loopback ports against other users of this machine. The user's token (env, token
    # file, `ray get-auth-token --generate`) is used if there is one; else a random one for this
    # process, so that nothing is written to ~/.ray and concurrent jobs cannot race on that file.
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").exists()):
        import secrets

        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # Loopback only. On Linux Ray 2.60 replaces a loopback node IP by the machine's address (it expects
    # other nodes to join) and then binds GCS, raylet, object manager, workers and agents to every
    # interface; with the single-node switch it uses on macOS/Windows (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
    # the node IP stays 127.0.0.1 and every one of them, metrics servers included, binds 127.0.0.1
    # (tests/e2e/test_network_exposure.py). Ray read that variable when imported, so its constant is
    # switched around this call only: other clusters this process joins are left as Ray sees them.
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray warns at start-up that token authentication is on and how to turn it off: here it is on by this
    # function's choice (a random token for this process, loopback ports), so the warning is not the user's.
    token_setup = logging.getLogger("ray._private.authentication.authentication_token_setup")
    token_level = token_setup.level
    token_setup.setLevel(logging.ERROR)
    try:
        ray.init(
            logging_level=level,
            runtime_env={"env_vars": WORKER_ENV},
            _node_ip_address="127.0.0.1",
            num_cpus=num_cpus, object_store_memory=object_store_memory_mb * 2**20,
            include_dashboard=include_dashboard, dashboard_host=dashboard_host,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
        token_setup.setLevel(token_level)
    spend_actor_restart_warning()


@contextlib.contextmanager
def ray_session(cfg: JobConfig, object_store_mb: int | None = None):
    """Use the caller's Ray (a test, a notebook), else start or join one for this job. `object_store_mb`: a
    local cluster's object store (default: pipelines/runtime/memory.py local_object_store_mb without a model,
    i.e. ray.object_store_memory_mb or 512)."""
    if ray.is_initialized():
        yield
        return
    init_ray(
        cfg.ray.address, cfg.ray.num_cpus,
        object_store_mb if object_store_mb is not None else local_object_store_mb(cfg, None),
        cfg.ray.include_dashboard, cfg.ray.dashboard_host,
    )
    try:
        yield
    finally:
        ray.shutdown()


def starts_local_cluster(cfg: JobConfig) -> bool:
    """Whether a job of `cfg` run here starts a Ray cluster of its own (no ray.address, not inside a submitted
    job, no Ray already joined by this process)."""
    return cfg.ray.address is None and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()


def local_store_problems(cfg: JobConfig, model_path: str | None) -> list[tuple[str, str]]:
    """What keeps the object store of the local cluster a job of `cfg` would start here from carrying it: a
    set ray.object_store_memory_mb too small for what goes through it (object_store_problem; only with the
    model folder at hand), or a store, set or sized, that /dev/shm has no room for (shm_problem). None to say
    when the job joins a cluster: check_object_store reads that cluster's stores once joined."""
    if not starts_local_cluster(cfg):
        return []
    store_mb = local_object_store_mb(cfg, model_path)
    found = [object_store_problem(cfg, model_path, store_mb, "local") if model_path else None,
             shm_problem(store_mb, chosen=cfg.ray.object_store_memory_mb is not None)]
    return [("ray.object_store_memory_mb", problem.split(": ", 1)[1]) for problem in found if problem]


def local_gpu_problems(cfg: JobConfig, local: bool | None = None) -> list[tuple[str, str]]:
    """A job that starts its own cluster here and asks for GPUs, where this Python's torch has no CUDA: each of
    its GPU actors would stop with a DeviceError (operators/common/devices.py) once started, or wait forever
    where Ray finds no GPU. The usual cause: the CPU venv (.venv) active on a GPU machine. `local`: whether the
    job starts its own cluster here (default: starts_local_cluster)."""
    sections = {"rollout": cfg.rollout, "train": cfg.train, "reference": cfg.reference, "critic": cfg.critic,
                "eval": cfg.eval}
    asked = [(f"{name}.num_gpus", section.num_gpus) for name, section in sections.items()
             if section is not None and section.num_gpus]
    if not asked or not (starts_local_cluster(cfg) if local is None else local):
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [(field, f"{gpus:g} GPU(s) asked for, but this Python's torch ({torch.__version__}) has no CUDA, and the "
                    "local cluster this job starts runs every actor with it. On a GPU machine run from the GPU "
                    "environment (`make install-gpu` builds .venv-gpu; `. .venv-gpu/bin/activate`); on CPUs set "
                    f"{field}: 0") for field, gpus in asked]


def check_object_store(cfg: JobConfig, model_path: str, store_mb: float | None = None, where: str = "",
                       nodes: list[dict] | None = None) -> None:
    """Refuse (ConfigError) an object store too small for what goes through it (pipelines/runtime/memory.py).
    `store_mb` given: one store through which everything goes (`where` names it; "local": a local cluster's).
    Else each live node of `nodes` (shaped like `ray.nodes()`; default: the connected cluster's), for what it
    may run: the job's actors that fit its resources (pipelines/runtime/resources.py's demands, which the
    placement checks use too), and the driver, which reads the DAG's output."""
    if store_mb is not None:
        problem = object_store_problem(cfg, model_path, store_mb, where)
        if problem:
            raise ConfigError([("ray.object_store_memory_mb", problem.split(": ", 1)[1])])
        return
    driver = ray.get_runtime_context().get_node_id() if nodes is None else None
    problems = []
    for node in ray.nodes() if nodes is None else nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        stages = stages_on_node(cfg, resources) | ({"driver"} if node.get("NodeID") == driver else set())
        name = (f"node {node.get('NodeManagerAddress') or node.get('NodeID', '?')[:8]} "
                f"(which may run {', '.join(sorted(stages)) or 'nothing of this job'})")
        problem = object_store_problem(cfg, model_path, resources.get("object_store_memory", 0) / 2**20, name, stages)
        if problem:
            problems.append(("ray.object_store_memory_mb", problem.split(": ", 1)[1]))
    if problems:
        raise ConfigError(problems)


def stages_on_node(cfg: JobConfig, resources: dict[str, float]) -> set[str]:
    """The job's actors (resources.demands' names) that a node with these total resources could run."""
    node = Node("", dict(resources))
    return {name for name, demand in demands(cfg).items() if node.fits(demand.resources)}
