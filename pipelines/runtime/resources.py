"""The resource plan of a job: what each actor asks Ray for, and whether it fits a cluster.

Checked twice before anything runs: against the cluster a config declares (`ray.cluster`,
at validation) and against the live cluster `streamrl submit` is about to use. A job that
does not fit would otherwise wait forever for resources, with no error from Ray.

The plan places actors greedily, largest first, as Ray's scheduler roughly does: the
trainer group by its placement strategy, then the generate and reward actors. A plan
that fits here can still fail on a fragmented cluster, but one that does not fit here
cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.config.cluster import NodeGroup
from pipelines.config.job import JobConfig

# The actor of build_rl_dataset's last stage (Advantage + the Train operator, pipelines/stages.py).
DAG_HELPER_CPUS = 0.1


@dataclass
class Demand:
    """`count` identical actors, each needing `resources` on one node."""

    stage: str
    count: int
    resources: dict[str, float]

    def describe(self) -> str:
        return f"{self.count} x {_format(self.resources)}"


@dataclass
class Node:
    name: str
    free: dict[str, float] = field(default_factory=dict)
    placed: list[str] = field(default_factory=list)  # the stages of the actors the plan put here, one per actor

    def fits(self, need: dict[str, float]) -> bool:
        return all(self.free.get(key, 0.0) + 1e-9 >= amount for key, amount in need.items() if amount > 0)

    def take(self, need: dict[str, float], stage: str = "", count: int = 1) -> None:
        for key, amount in need.items():
            self.free[key] = self.free.get(key, 0.0) - amount
        self.placed += [stage] * count


def _format(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in resources.items() if value) + "}"


def _actor(num_cpus: float, num_gpus: float, custom: dict[str, float]) -> dict[str, float]:
    return {"CPU": num_cpus, "GPU": num_gpus, **custom}


def demands(cfg: JobConfig) -> dict[str, Demand]:
    """What the job asks Ray for, by stage."""
    return {
        "train": Demand("train", cfg.train.world_size, _actor(cfg.train.num_cpus, cfg.train.num_gpus, cfg.train.resources)),
        "generate": Demand(
            "generate", cfg.rollout.min_actors, _actor(cfg.rollout.num_cpus, cfg.rollout.num_gpus, cfg.rollout.resources)
        ),
        **({"reward": Demand("reward", cfg.reward.num_actors, _actor(cfg.reward.num_cpus, 0, {}))}
           if cfg.reward.placement == "stage" else {}),  # "generate": inside the generate actors
        "helpers": Demand("helpers", 1, _actor(DAG_HELPER_CPUS, 0, {})),
        **({"eval": Demand("eval", 1, _actor(cfg.eval.num_cpus, cfg.eval.num_gpus, cfg.eval.resources))}
           if cfg.eval is not None else {}),
        **({"reference": Demand("reference", cfg.reference.num_actors, _actor(
            cfg.reference.num_cpus, cfg.reference.num_gpus, cfg.reference.resources))}
           if cfg.reference is not None and not cfg.reference_on_trainer() else {}),
        **({"critic": Demand("critic", cfg.critic.world_size,
                             _actor(cfg.critic.num_cpus, cfg.critic.num_gpus, cfg.critic.resources)),
            "value": Demand("value", 1, _actor(cfg.critic.value_num_cpus, 0, {}))}
           if cfg.critic is not None else {}),
    }


def stage_options(cfg: JobConfig) -> dict[str, dict]:
    """Ray options beyond CPUs for build_rl_dataset's stages (GPUs, custom resources). A generate
    actor whose engine spans several GPUs reserves them in its placement group instead
    (pipelines/runtime/placement.py: build_rl_dataset makes it)."""
    stages = {"generate": {"num_gpus": cfg.rollout.num_gpus, "resources": cfg.rollout.resources}}
    if cfg.reference is not None and not cfg.reference_on_trainer():
        stages["reference"] = {"num_gpus": cfg.reference.num_gpus, "resources": cfg.reference.resources}
    return {stage: {key: value for key, value in options.items() if value} for stage, options in stages.items()}


def _tensor_parallel_problem(cfg: JobConfig, nodes: list[Node]) -> str | None:
    """One engine's GPUs form a STRICT_PACK placement group: a node must hold all of them."""
    tp = cfg.rollout.vllm.tensor_parallel_size
    if tp == 1 or not cfg.rollout.num_gpus:
        return None
    largest = max(node.free.get("GPU", 0.0) for node in nodes)
    if largest >= tp:
        return None
    return (f"rollout.vllm.tensor_parallel_size: {tp} puts one vLLM engine's {tp} GPUs on one node (a STRICT_PACK "
            f"placement group per generate actor), and the node with the most has {largest:g}; set "
            f"tensor_parallel_size and rollout.num_gpus to {largest:g} or less, or add nodes with {tp} GPUs")


def totals(cfg: JobConfig) -> dict[str, float]:
    """Sum of everything the job reserves, e.g. {'CPU': 9.6, 'GPU': 8}."""
    out: dict[str, float] = {}
    for demand in demands(cfg).values():
        for key, amount in demand.resources.items():
            out[key] = out.get(key, 0.0) + amount * demand.count
    return {key: value for key, value in out.items() if value}


def declared_nodes(groups: list[NodeGroup]) -> list[Node]:
    nodes = []
    for group_index, group in enumerate(groups):
        for index in range(group.count):
            nodes.append(Node(
                f"ray.cluster.{group_index}[{index}]",
                {"CPU": group.num_cpus, "GPU": group.num_gpus, **group.resources},
            ))
    return nodes


def live_nodes(resources_by_node: dict[str, dict[str, float]]) -> list[Node]:
    """Nodes of a running cluster from {node id: total resources}."""
    return [Node(f"node {node_id[:8]}", dict(resources)) for node_id, resources in resources_by_node.items()]


def plan_problems(cfg: JobConfig, nodes: list[Node]) -> list[str]:
    """Why the job cannot be placed on `nodes` (empty when it fits); `nodes` are left unchanged."""
    return placement(cfg, nodes)[1]


def placement(cfg: JobConfig, nodes: list[Node]) -> tuple[list[Node], list[str]]:
    """The plan: copies of `nodes`, each with the stages of the actors put on it (`placed`) and what is left
    free, and why the job cannot be placed (empty when it fits); `nodes` are left unchanged."""
    nodes = [Node(node.name, dict(node.free)) for node in nodes]
    if not nodes:
        return nodes, ["the cluster has no nodes"]
    problems = []
    stages = demands(cfg)
    problem = _tensor_parallel_problem(cfg, nodes)
    if problem:  # the generate actors cannot be placed; the plan below would only repeat it less clearly
        problems.append(problem)
        stages.pop("generate")
    if cfg.train.placement == "NONE" and cfg.train.world_size > 1 and len(nodes) > 1:
        problems.append(
            "train.placement: NONE meets the ranks on 127.0.0.1, which only works when they share one machine; "
            "on a cluster of several nodes use PACK, STRICT_PACK or STRICT_SPREAD"
        )
    trainer = stages.pop("train")
    problem = _place_trainer(trainer, cfg.train.placement, nodes)
    if problem:
        problems.append(problem)
    for demand in sorted(stages.values(), key=lambda d: (d.resources.get("GPU", 0), d.resources["CPU"]), reverse=True):
        for placed in range(demand.count):
            node = next((node for node in nodes if node.fits(demand.resources)), None)
            if node is None:
                problems.append(
                    f"{demand.stage} needs {demand.describe()} but only {placed} fit beside the trainer group; "
                    f"free per node: {_free(nodes)}. Lower the {demand.stage} actors' count or resources, or add nodes"
                )
                break
            node.take(demand.resources, demand.stage)
    return nodes, problems


def _free(nodes: list[Node]) -> str:
    return "; ".join(f"{node.name} {_format(node.free)}" for node in nodes)


def _place_trainer(trainer: Demand, strategy: str, nodes: list[Node]) -> str | None:
    need = trainer.resources
    if strategy == "STRICT_PACK":  # NONE, PACK and SPREAD may use any node with room
        group = {key: amount * trainer.count for key, amount in need.items()}
        node = next((node for node in nodes if node.fits(group)), None)
        if node is None:
            return (f"train.placement: STRICT_PACK puts all {trainer.count} ranks ({_format(group)}) on one node, "
                    f"and no node has that: {_free(nodes)}. Use PACK, or fewer ranks")
        node.take(group, trainer.stage, trainer.count)
        return None
    used: set[str] = set()
    for rank in range(trainer.count):
        candidates = [node for node in nodes if node.fits(need) and not (strategy == "STRICT_SPREAD" and node.name in used)]
        if not candidates:
            spread = " on distinct nodes (STRICT_SPREAD)" if strategy == "STRICT_SPREAD" else ""
            return (f"train needs {trainer.describe()}{spread} but only {rank} rank(s) fit; free per node: "
                    f"{_free(nodes)}. Lower train.world_size or its resources, or add nodes")
        node = candidates[0]
        node.take(need, trainer.stage)
        used.add(node.name)
    return None
