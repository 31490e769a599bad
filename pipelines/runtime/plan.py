"""`streamrl plan`: what a config needs from a cluster, worked out without one.

For a config and a cluster (its `ray.cluster`, or `--gpus N --gpu-memory-gb G [--nodes K] [--cpus C]`), and the
model's dimensions (its config.json: the model folder, the Hugging Face cache, or `--model-config FILE` for a Hub
id not downloaded), it prints:

- the placement: which actors each node runs (pipelines/runtime/resources.py, the plan validation checks);
- the memory of each GPU: a trainer rank's estimate by component (pipelines/runtime/memory.py) against 90% of
  its GPUs, and a vLLM engine's share (`gpu_memory_utilization` of its GPUs), its weights and the KV cache left;
- per host: the object store that node needs for what goes through it, and the /dev/shm it needs (that store,
  and on the object-store plane one weight file per vLLM engine on the node);
- the weight plane the job will use, and why.

Everything here is an estimate from the dimensions; nothing is measured. Exit 2 when something does not fit.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.config.job import JobConfig
from pipelines.runtime.memory import (
    GIB, MIB, config_shape, model_shape, parameter_count, trainer_rank_estimate, weight_channel_mb,
)
from pipelines.runtime.resources import declared_nodes, placement
from pipelines.runtime.rollout_settings import weight_plane

VLLM_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # auto: the checkpoint's, 16-bit for most
TRAINER_SHARE = 0.9  # of a rank's GPUs, as trainer_memory_problem allows


class PlanError(ValueError):
    """The plan cannot be worked out (no cluster, no model dimensions): what to pass."""


def cluster_overrides(gpus: int | None, gpu_memory_gb: float | None, nodes: int, cpus: float | None) -> list[str]:
    """`--set` overrides that declare the cluster the flags describe (none without --gpus)."""
    if gpus is None:
        if gpu_memory_gb is not None:
            raise PlanError("--gpu-memory-gb needs --gpus (the GPUs per node)")
        return []
    cpus = cpus if cpus is not None else (12 * gpus if gpus else 8)  # 8-GPU nodes have 96 to 224 vCPUs
    memory = f", gpu_memory_gb: {gpu_memory_gb:g}" if gpu_memory_gb else ""
    return [f"ray.cluster=[{{count: {nodes}, num_cpus: {cpus:g}, num_gpus: {gpus}{memory}}}]"]


def find_shape(cfg: JobConfig, model_config: str | None) -> tuple[dict, str]:
    """The model's dimensions and where they were read."""
    if model_config:
        path = Path(model_config)
        if not path.is_file():
            raise PlanError(f"--model-config {model_config}: no such file (the model's config.json)")
        shape = config_shape(json.loads(path.read_text()))
        if shape is None:
            raise PlanError(f"--model-config {model_config}: not a decoder's config.json (it lacks hidden_size, "
                            "num_hidden_layers, intermediate_size, vocab_size or num_attention_heads)")
        return shape, str(path)
    from pipelines.data.models import cached_model_path

    folder = cached_model_path(cfg.model.path, cfg.model.revision)  # nothing downloaded or built to plan
    shape = model_shape(folder) if folder else None
    if shape is None:
        raise PlanError(f"model.path {cfg.model.path}: its config.json is not at hand (not a local folder, not in the "
                        "Hugging Face cache, a builtin not built yet); pass --model-config with the model's "
                        "config.json (a few KB, e.g. `hf download ORG/NAME config.json`)")
    return shape, f"{folder}/config.json"


def job_plan(cfg: JobConfig, shape: dict, shape_source: str) -> dict:
    """The plan as a record (see the module docstring); `problems` lists what does not fit."""
    if not cfg.ray.cluster:
        raise PlanError("no cluster to plan on: give --gpus N (and --gpu-memory-gb G, --nodes K, --cpus C) or set "
                        "ray.cluster in the config")
    nodes, problems = placement(cfg, declared_nodes(cfg.ray.cluster))
    memory = min((g.gpu_memory_gb for g in cfg.ray.cluster if g.num_gpus and g.gpu_memory_gb), default=None)
    params = parameter_count(shape)
    record = {"model": {"parameters": params, "config": shape_source}, "nodes": [], "gpus": {}, "problems": problems,
              "weight_plane": _plane(cfg)}
    trainer = trainer_rank_estimate(cfg, shape)
    rank_gpus = cfg.train.num_gpus
    if rank_gpus:
        budget = TRAINER_SHARE * memory * rank_gpus if memory else None
        record["gpus"]["train"] = {"per_rank_gib": trainer["total"], "budget_gib": budget, "gpus": rank_gpus,
                                   "parts": trainer["parts"], "micro_batch_tokens": trainer["tokens"]}
        if budget is not None and trainer["total"] > budget:
            problems.append(f"train: a rank needs an estimated {trainer['total']:.1f} GiB of {budget:.0f} GiB "
                            f"({TRAINER_SHARE:.0%} of {rank_gpus:g} x {memory:g} GiB)")
    if cfg.rollout.engine == "vllm" and cfg.rollout.num_gpus:
        tp = cfg.rollout.vllm.tensor_parallel_size
        weights = params * VLLM_DTYPE_BYTES[cfg.rollout.vllm.dtype] / tp / GIB
        share = cfg.rollout.vllm.gpu_memory_utilization * memory if memory else None
        record["gpus"]["generate"] = {"weights_gib_per_gpu": weights, "share_gib": share, "gpus": cfg.rollout.num_gpus,
                                      "kv_cache_gib": share - weights if share else None}
        if share is not None and weights >= share:
            problems.append(f"rollout.vllm.gpu_memory_utilization: an engine's weights take {weights:.1f} GiB a GPU, "
                            f"more than its share ({share:.1f} GiB); raise it, or tensor_parallel_size")
    policy_file_mb = params * (2 if cfg.train.dtype == "bf16" else 4) / MIB  # a weight file: the training dtype
    files = record["weight_plane"]["name"] == "object_store" and cfg.rollout.engine == "vllm"
    for index, node in enumerate(nodes):
        stages = set(node.placed) | ({"driver"} if index == 0 else set())
        store = weight_channel_mb(cfg, None, stages, shape=shape) or {"total_mb": 0.0}
        engines = node.placed.count("generate") + (node.placed.count("eval") if _eval_vllm(cfg) else 0)
        shm = store["total_mb"] + (engines * policy_file_mb if files else 0.0)
        record["nodes"].append({"name": node.name, "actors": _counts(node.placed), "free": node.free,
                                "object_store_mb": store["total_mb"], "dev_shm_mb": shm})
    return record


def _eval_vllm(cfg: JobConfig) -> bool:
    return cfg.eval is not None and (cfg.eval.engine or cfg.rollout.engine) == "vllm"


def _counts(stages: list[str]) -> dict[str, int]:
    return {stage: stages.count(stage) for stage in dict.fromkeys(stages)}


def _plane(cfg: JobConfig) -> dict:
    name = weight_plane(cfg)
    on_gpus = cfg.rollout.num_gpus > 0 or cfg.train.num_gpus > 0
    why = ("vLLM's weight-transfer API over gloo, rank 0 to every in-flight engine" if name == "gloo" else
           "NCCL and CUDA IPC are not wired yet (issue 45): trainer rank 0 puts each version in Ray's object store "
           "and each engine writes it to a file it loads" if on_gpus else
           "the engines pull each version from Ray's object store")
    return {"name": name, "why": why}


def plan_text(config: str, record: dict) -> str:
    """The plan for a reader: a line a node, a line a kind of GPU actor, the weight plane, what does not fit."""
    model = record["model"]
    lines = [f"streamrl plan: {config}, {model['parameters'] / 1e9:.2f}B parameters ({model['config']})", "placement:"]
    for node in record["nodes"]:
        actors = ", ".join(f"{stage} x{count}" for stage, count in node["actors"].items()) or "nothing"
        free = ", ".join(f"{key} {value:g}" for key, value in node["free"].items() if value and ":" not in key)
        lines.append(f"  {node['name']}: {actors} (left free: {free or 'nothing'})")
    lines.append("memory per GPU (estimates):")
    train = record["gpus"].get("train")
    if train:
        parts = ", ".join(f"{name} {gib:.1f}" for name, gib in train["parts"].items())
        budget = f" of {train['budget_gib']:.0f} GiB" if train["budget_gib"] else ""
        lines.append(f"  trainer rank ({train['gpus']:g} GPU): {train['per_rank_gib']:.1f} GiB{budget} ({parts}; "
                     f"micro-batches of {train['micro_batch_tokens']} tokens)")
    generate = record["gpus"].get("generate")
    if generate:
        share = (f"{generate['share_gib']:.1f} GiB share: weights {generate['weights_gib_per_gpu']:.1f} GiB, KV cache "
                 f"{generate['kv_cache_gib']:.1f} GiB" if generate["share_gib"] else
                 f"weights {generate['weights_gib_per_gpu']:.1f} GiB")
        lines.append(f"  vLLM engine ({generate['gpus']:g} GPU): {share}")
    if not train and not generate:
        lines.append("  no GPU actors")
    lines.append("per host (a local cluster's store is sized 25% above; `ray start --object-store-memory` for others):")
    for node in record["nodes"]:
        lines.append(f"  {node['name']}: object store {node['object_store_mb'] / 1024:.1f} GiB, /dev/shm "
                     f"{node['dev_shm_mb'] / 1024:.1f} GiB")
    plane = record["weight_plane"]
    lines.append(f"weight plane: {plane['name']} ({plane['why']})")
    if record["problems"]:
        lines.append("does not fit:")
        lines += [f"  - {problem}" for problem in record["problems"]]
    else:
        lines.append("fits.")
    return "\n".join(lines)
