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

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from operators.workers.deepspeed_setup import free_port
from operators.workers.train_worker import TrainWorker
from operators.workers.value_worker import ValueWorker
from pipelines.config.job import JobConfig
from pipelines.runtime.trainer_settings import critic_settings, trainer_settings


class TrainerGroup(list):
    """The rank actors, in rank order, plus the placement group holding them (or None); a critic
    group also carries its model folder and its store actor (the handle)."""

    placement_group = None
    model_path: str | None = None
    store = None
    ready_refs: tuple | list = ()  # each rank's `ready` call, made when the rank was created

    def wait_ready(self) -> list[dict]:
        """Wait until every rank has initialised DeepSpeed; where each runs. A rank whose start failed
        raises its error here."""
        return ray.get(self.ready_refs)


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
    pick = ray.remote(num_cpus=0)(free_port).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    return address, ray.get(pick.remote())


def start_trainer_group(cfg: JobConfig, model_path: str, policy_store) -> tuple[TrainerGroup, list[dict]]:
    """Create the ranks, wait until every one has initialised DeepSpeed; return handles and placement.

    Stop it with `stop_trainer_group`, which also frees the placement group."""
    workers = launch_trainer_group(cfg, model_path, policy_store)
    return workers, _placement(workers)


def launch_trainer_group(cfg: JobConfig, model_path: str, policy_store) -> TrainerGroup:
    """Reserve the ranks' resources (an error now if the cluster has no room) and create the ranks without
    waiting for them to initialise: the engines can start meanwhile. `workers.wait_ready()` waits."""
    return _start_group(cfg.train, "train", TrainWorker, (trainer_settings(cfg, model_path), policy_store))


def _placement(workers: TrainerGroup) -> list[dict]:
    try:
        return workers.wait_ready()
    except BaseException:  # no half-started group, no reserved bundles left behind
        stop_trainer_group(workers)
        raise


def start_critic_group(cfg: JobConfig, model_path: str, value_store) -> tuple[TrainerGroup, list[dict]]:
    """The critic's ranks (operators.workers.value_worker.ValueWorker), publishing to the store `value_store`
    (create it with initial_version=-1: rank 0 publishes the freshly initialised critic as version 0)."""
    workers = _start_group(cfg.critic, "critic", ValueWorker,
                           (critic_settings(cfg, model_path), value_store, cfg.critic.value_clip))
    workers.model_path, workers.store = model_path, value_store
    return workers, _placement(workers)


def _start_group(section, name: str, worker_class, args: tuple) -> TrainerGroup:
    """`section.world_size` ranks of `worker_class(rank, world_size, port, *args)` (section: train or critic),
    created, with their `ready` calls made."""
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
            port = free_port()
        else:
            workers.placement_group, order, rank0_node = _reserve(section, name)
            env["STREAMRL_MASTER_ADDR"], port = _rendezvous_on(rank0_node)
            options = [
                {"scheduling_strategy": PlacementGroupSchedulingStrategy(workers.placement_group, bundle_index)}
                for bundle_index in order
            ]
        for rank in range(section.world_size):
            workers.append(actor.options(**common, **options[rank]).remote(rank, section.world_size, port, *args))
        workers.ready_refs = [worker.ready.remote() for worker in workers]
    except BaseException:  # no half-started group, no reserved bundles left behind
        stop_trainer_group(workers)
        raise
    return workers


def stop_trainer_group(workers: list) -> None:
    for worker in workers:
        ray.kill(worker)
    group = getattr(workers, "placement_group", None)
    if group is not None:
        remove_placement_group(group)
