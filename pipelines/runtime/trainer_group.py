"""Start the DeepSpeed worker group: `world_size` Ray actors, one rank each.

With `train.placement` set to a placement-group strategy (PACK, SPREAD, STRICT_PACK,
STRICT_SPREAD) every rank's resources are reserved at once, before any rank starts, so a
cluster that cannot hold the whole group fails the job with a clear error instead of
half-starting it. The ranks then meet at rank 0's node (its IP, a port free there); rank
0 goes on the driver's node when a bundle landed there, so the checkpoint it writes is on
the driver's disk. `NONE` schedules ranks one by one and meets on 127.0.0.1: one machine only.

The critic group of PPO with GAE (config section `critic`) is started the same way, with
its own section's world size, resources and placement, and publishes to its own store.
"""

from __future__ import annotations

import socket

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from operators.algorithms.estimators import STEP_WHITENED
from operators.algorithms.correction import CorrectionSettings
from operators.workers.settings import LrSchedule, TrainerSettings
from operators.workers.train_worker import TrainWorker
from operators.workers.value_worker import ValueWorker
from pipelines.config.schema import JobConfig, ModelConfig


class TrainerGroup(list):
    """The rank actors, in rank order, plus the placement group holding them (or None); a critic
    group also carries its model folder and its store actor (the handle)."""

    placement_group = None
    model_path: str | None = None
    store = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def updates_per_step(cfg: JobConfig) -> int:
    """Optimizer steps per train step (the LR schedule advances per optimizer step)."""
    return cfg.train.ppo_epochs * cfg.train.mini_batches


# Where each TrainerSettings field comes from in the config: the one map from config to trainer (a
# field not named here keeps TrainerSettings' default, which tests/test_trainer_group_settings checks
# equals the config's). The critic's ranks read the same map with CRITIC_SETTINGS on top.
POLICY_SETTINGS = {
    "lr": "train.lr", "betas": "train.betas", "weight_decay": "train.weight_decay", "grad_clip": "train.grad_clip",
    "zero_stage": "train.zero_stage", "dtype": "train.dtype", "seed": "train.seed",
    "torch_threads": "train.torch_threads", "micro_batch_tokens": "train.micro_batch_tokens",
    "logits_chunk_tokens": "train.logits_chunk_tokens", "gradient_checkpointing": "train.gradient_checkpointing",
    "weight_bucket_mb": "train.weight_bucket_mb", "nan_policy": "train.nan_policy",
    "zero3_persistence_threshold": "train.zero3_persistence_threshold", "ppo_epochs": "train.ppo_epochs",
    "mini_batches": "train.mini_batches", "temperature": "rollout.temperature",
    "trust_remote_code": "model.trust_remote_code",
    "policy_loss": "algorithm.policy_loss", "loss_aggregation": "algorithm.loss_aggregation",
    "clip_eps_low": "algorithm.clip_eps_low", "clip_eps_high": "algorithm.clip_eps_high",
    "clip_ratio_c": "algorithm.clip_ratio_c", "kl_coef": "algorithm.kl_coef",
    "kl_estimator": "algorithm.kl_estimator", "entropy_coef": "algorithm.entropy_coef",
}
# The critic: its own section's optimiser and ranks; the policy's step shape (micro-batches, epochs,
# mini-batches), seed and NaN policy; none of the policy loss's settings (the critic's loss is its own).
CRITIC_SETTINGS = {
    **{name: POLICY_SETTINGS[name] for name in (
        "seed", "micro_batch_tokens", "gradient_checkpointing", "weight_bucket_mb", "nan_policy",
        "zero3_persistence_threshold", "ppo_epochs", "mini_batches", "trust_remote_code")},
    "lr": "critic.lr", "grad_clip": "critic.grad_clip", "zero_stage": "critic.zero_stage",
    "torch_threads": "critic.torch_threads",
}


def _config_value(cfg: JobConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return tuple(value) if isinstance(value, list) else value


def _settings(cfg: JobConfig, model_path: str, table: dict[str, str], **extra) -> TrainerSettings:
    return TrainerSettings(model_path=model_path, **{name: _config_value(cfg, path) for name, path in table.items()},
                           **extra)


def trainer_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The policy ranks' settings (POLICY_SETTINGS, plus the LR schedule and the off-policy correction,
    which are built from several fields)."""
    return _settings(
        cfg, model_path, POLICY_SETTINGS, max_new_tokens=cfg.policy_budget(),
        lr_schedule=LrSchedule(
            warmup_steps=cfg.train.lr_warmup_steps * updates_per_step(cfg),
            total_steps=cfg.train.steps * updates_per_step(cfg),
            kind=cfg.train.lr_schedule, min_ratio=cfg.train.lr_min_ratio,
        ),
        correction=CorrectionSettings(
            tis=cfg.algorithm.tis, tis_cap=cfg.algorithm.tis_cap,
            mis=cfg.algorithm.mis, mis_low=cfg.algorithm.mis_low, mis_high=cfg.algorithm.mis_high,
        ),
    )


def critic_settings(cfg: JobConfig, model_path: str) -> TrainerSettings:
    """The critic's DeepSpeed settings: its own section's, and the policy's update schedule."""
    return _settings(cfg, model_path, CRITIC_SETTINGS)


def critic_model_path(cfg: JobConfig, policy_path: str) -> str:
    """The critic's local folder (`policy_path`, already resolved, when it is the policy's model)."""
    if cfg.critic.model_path == cfg.model.path:
        return policy_path
    from pipelines.data.models import resolve_model_path

    return resolve_model_path(ModelConfig(path=cfg.critic.model_path, trust_remote_code=cfg.model.trust_remote_code),
                              "critic.model_path")


def advantage_options(cfg: JobConfig) -> dict:
    """Constructor arguments of the Advantage operator (operators.advantage)."""
    options = {"estimator": cfg.algorithm.advantage, "max_new_tokens": cfg.policy_budget(),
               "overlong_buffer": cfg.algorithm.overlong_buffer, "overlong_penalty": cfg.algorithm.overlong_penalty,
               "kl_reward_coef": cfg.algorithm.kl_reward_coef}
    if cfg.critic is not None:  # a token estimator (config validation)
        options.update(gamma=cfg.algorithm.gamma, gae_lambda=cfg.algorithm.gae_lambda)
    return options


def train_options(cfg: JobConfig) -> dict:
    """The algorithm's constructor arguments of the Train operator (operators.train)."""
    if cfg.algorithm.advantage in STEP_WHITENED:
        whiten = cfg.algorithm.whiten_over
    else:  # GAE's advantages are per token: over the trained tokens
        whiten = "token" if cfg.critic is not None and cfg.algorithm.gae_whiten else None
    return {"whiten_advantages": whiten,
            "mini_batches": cfg.train.mini_batches}


def _reserve(section, name: str):
    """Reserve one bundle per rank; return the group and its bundle indices in rank order."""
    role = {"train": "trainer"}.get(name, name)
    bundle = {"CPU": section.num_cpus, "GPU": section.num_gpus, **section.resources}
    bundle = {key: amount for key, amount in bundle.items() if amount}
    group = placement_group([bundle] * section.world_size, strategy=section.placement)
    ready, _ = ray.wait([group.ready()], timeout=section.placement_timeout_s)
    if not ready:
        remove_placement_group(group)
        raise TimeoutError(
            f"{name}.placement: the cluster found no room for {section.world_size} {role} rank(s) of {bundle} "
            f"({section.placement}) within {name}.placement_timeout_s={section.placement_timeout_s:g}; "
            f"free now: {ray.available_resources()}. Lower {name}.world_size or its resources, or add nodes"
        )
    nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    # Rank 0 writes the checkpoint: keep it on the driver's node when a bundle is there.
    order = sorted(range(section.world_size), key=lambda index: (nodes[index] != here, index))
    return group, order, nodes[order[0]]


def _rendezvous_on(node_id: str) -> tuple[str, int]:
    """Rank 0's node IP and a port free on that node."""
    address = next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)
    pick = ray.remote(num_cpus=0)(_free_port).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    return address, ray.get(pick.remote())


def start_trainer_group(cfg: JobConfig, model_path: str, policy_store) -> tuple[TrainerGroup, list[dict]]:
    """Create the ranks, wait until every one has initialised DeepSpeed; return handles and placement.

    Stop it with `stop_trainer_group`, which also frees the placement group."""
    return _start_group(cfg.train, "train", TrainWorker, (trainer_settings(cfg, model_path), policy_store))


def start_critic_group(cfg: JobConfig, model_path: str, value_store) -> tuple[TrainerGroup, list[dict]]:
    """The critic's ranks (operators.workers.value_worker.ValueWorker), publishing to the store `value_store`
    (create it with initial_version=-1: rank 0 publishes the freshly initialised critic as version 0)."""
    workers, placement = _start_group(cfg.critic, "critic", ValueWorker,
                                      (critic_settings(cfg, model_path), value_store, cfg.critic.value_clip))
    workers.model_path, workers.store = model_path, value_store
    return workers, placement


def _start_group(section, name: str, worker_class, args: tuple) -> tuple[TrainerGroup, list[dict]]:
    """`section.world_size` ranks of `worker_class(rank, world_size, port, *args)` (section: train or critic)."""
    workers = TrainerGroup()
    env = {"DS_ACCELERATOR": "cuda" if section.num_gpus else "cpu"}
    options = [{} for _ in range(section.world_size)]
    actor = ray.remote(worker_class)
    common = {
        "num_cpus": section.num_cpus, "num_gpus": section.num_gpus, "resources": section.resources or None,
        "max_concurrency": 1, "runtime_env": {"env_vars": env},
    }
    try:
        if section.placement == "NONE":
            port = _free_port()
        else:
            workers.placement_group, order, rank0_node = _reserve(section, name)
            env["STREAMRL_MASTER_ADDR"], port = _rendezvous_on(rank0_node)
            options = [
                {"scheduling_strategy": PlacementGroupSchedulingStrategy(workers.placement_group, bundle_index)}
                for bundle_index in order
            ]
        for rank in range(section.world_size):
            workers.append(actor.options(**common, **options[rank]).remote(rank, section.world_size, port, *args))
        placement = ray.get([worker.ready.remote() for worker in workers])
    except BaseException:  # no half-started group, no reserved bundles left behind
        stop_trainer_group(workers)
        raise
    return workers, placement


def stop_trainer_group(workers: list) -> None:
    for worker in workers:
        ray.kill(worker)
    group = getattr(workers, "placement_group", None)
    if group is not None:
        remove_placement_group(group)
