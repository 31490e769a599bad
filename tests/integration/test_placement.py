"""vLLM tensor parallel and per-replica placement: the config refuses what cannot run, each generate
replica gets a STRICT_PACK placement group of its own that the job removes, and the DAG's stages pass
their Ray options without Ray 2.60's deprecated forms (loose map_batches keywords)."""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.config.world import vllm_installed

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_grpo.yaml"
needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="rollout.engine: vllm needs vLLM installed")


@contextlib.contextmanager
def no_remote_args_deprecation():
    """Fails on Ray's warning about `ray_remote_args` / `ray_remote_args_fn` (removed in Ray 2.64)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    about = [str(w.message) for w in caught if "ray_remote_args" in str(w.message)]
    assert not about, about


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    return dict(info.value.problems)


# --- config ------------------------------------------------------------------------------


def test_tensor_parallel_needs_the_vllm_engine():
    problems = problems_of(["rollout.engine=hf", "rollout.vllm.tensor_parallel_size=2"])
    assert "rollout.engine: vllm" in problems["rollout.vllm.tensor_parallel_size"]


@needs_vllm
def test_tensor_parallel_gpus_must_match_num_gpus():
    problems = problems_of(["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=4", "rollout.num_gpus=1"])
    assert "set rollout.num_gpus: 4" in problems["rollout.num_gpus"]
    # a vLLM engine of one GPU cannot use two: say how to split it
    problems = problems_of(["rollout.engine=vllm", "rollout.num_gpus=2"])
    assert "tensor_parallel_size: 2" in problems["rollout.num_gpus"]
    for fine in (["rollout.num_gpus=4"], ["rollout.num_gpus=0"]):  # each engine's GPUs, or CPU
        cfg = load_config(TINY, ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=4", *fine])
        assert cfg.rollout.vllm.tensor_parallel_size == 4


@needs_vllm
def test_the_evaluator_engine_takes_the_tensor_parallel_size():
    base = ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2", "rollout.num_gpus=2",
            "eval.data.path=builtin:arithmetic-heldout"]
    problems = problems_of([*base, "eval.num_gpus=1"])
    assert "set eval.num_gpus: 2" in problems["eval.num_gpus"]
    assert load_config(TINY, [*base, "eval.num_gpus=2"]).eval.num_gpus == 2
    assert load_config(TINY, [*base, "eval.num_gpus=1", "eval.engine=hf"]).eval.engine == "hf"


@needs_vllm
def test_a_tensor_parallel_engine_must_fit_one_node():
    gpu = ["rollout.engine=vllm", "rollout.num_gpus=4", "rollout.vllm.tensor_parallel_size=4",
           "train.num_gpus=1", "train.placement=PACK"]
    two_small = "ray.cluster=[{count: 4, num_cpus: 16, num_gpus: 2}]"  # 8 GPUs, but 2 per node
    problems = problems_of([*gpu, two_small])
    message = problems["ray.cluster"]
    assert "rollout.vllm.tensor_parallel_size: 4" in message and "rollout.num_gpus" in message
    assert "has 2" in message
    cfg = load_config(TINY, [*gpu, "ray.cluster=[{count: 1, num_cpus: 16, num_gpus: 8}]"])
    assert cfg.ray.cluster[0].num_gpus == 8


def test_engine_options_name_the_executor():
    from pipelines.stages import engine_options

    def options(*overrides, replica_group=True):
        cfg = load_config(TINY, ["rollout.engine=vllm", *overrides]) if vllm_installed() else None
        return None if cfg is None else engine_options(cfg, replica_group=replica_group)

    if not vllm_installed():
        pytest.skip("rollout.engine: vllm needs vLLM installed")
    assert "distributed_executor_backend" not in options()  # one device: vLLM's single-process executor
    assert options()["tensor_parallel_size"] == 1
    gpu = ("rollout.vllm.tensor_parallel_size=2", "rollout.num_gpus=2")
    assert options(*gpu)["distributed_executor_backend"] == "ray"  # a worker per bundle of the group
    assert options(*gpu, replica_group=False)["distributed_executor_backend"] == "mp"  # the evaluator
    assert options("rollout.vllm.tensor_parallel_size=2")["distributed_executor_backend"] == "mp"  # CPU


def test_engine_bundles():
    from pipelines.runtime.placement import engine_bundles

    assert engine_bundles(4, 2.0, 4, {"rollout_node": 1}) == [
        {"CPU": 2.0, "rollout_node": 1, "GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert engine_bundles(2, 1.0, 0, {}) == [{"CPU": 1.0}]  # CPU: vLLM's workers are the actor's processes


# --- placement groups on a real local cluster -------------------------------------------


def _live(placement) -> list[str]:
    return [entry["name"] for entry in placement.groups()]


def test_one_placement_group_per_replica_reused_when_a_replica_is_replaced(ray_cluster):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pipelines.runtime.placement import ReplicaPlacement

    bundles = [{"CPU": 0.1}, {"CPU": 0.05}]
    placement = ReplicaPlacement(bundles, replicas=2)
    try:
        first, second = placement(), placement()
        strategies = [first["scheduling_strategy"], second["scheduling_strategy"]]
        assert all(isinstance(s, PlacementGroupSchedulingStrategy) for s in strategies)
        assert all(s.placement_group_capture_child_tasks and s.placement_group_bundle_index == 0
                   for s in strategies)
        groups = [s.placement_group for s in strategies]
        assert groups[0].id != groups[1].id
        table = ray.util.placement_group_table()
        for group in groups:
            assert ray.get(group.ready(), timeout=30)
            entry = table[group.id.hex()]
            assert entry["strategy"] == "STRICT_PACK"
            assert list(entry["bundles"].values()) == bundles
        assert _live(placement) == [f"{placement.prefix}-0", f"{placement.prefix}-1"]

        @ray.remote(num_cpus=0.1)
        class Replica:
            def group(self):
                return ray.util.get_current_placement_group().id.hex()

        replicas = [Replica.options(**first).remote(), Replica.options(**second).remote()]
        assert ray.get([r.group.remote() for r in replicas]) == [g.id.hex() for g in groups]
        ray.kill(replicas[0], no_restart=True)  # gone for good: Ray Data would start another
        deadline = time.time() + 30
        while time.time() < deadline and placement._vacant(placement.groups()) is None:
            time.sleep(0.1)
        again = placement()["scheduling_strategy"].placement_group
        assert again.id == groups[0].id  # the dead replica's group (its reservation), not a third one
        assert len(_live(placement)) == 2
    finally:
        assert placement.release() == 2
    assert _live(placement) == []


def test_a_stage_runs_its_actors_in_their_groups_without_deprecation_warnings(ray_cluster):
    import ray
    from ray.data import ActorPoolStrategy

    from pipelines.runtime.placement import ReplicaPlacement, drop_remote_args_probes, map_stage

    drop_remote_args_probes(ray.data.DataContext.get_current())  # as build_rl_dataset does

    class GroupProbe:  # stands for Generate (defined here: pickled by value for the workers)
        def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
            group = ray.util.get_current_placement_group()
            return batch.assign(group=group.id.hex() if group else "")

    placement = ReplicaPlacement([{"CPU": 0.1}], replicas=2)
    frames = [pd.DataFrame({"x": [i]}) for i in range(6)]
    try:
        with no_remote_args_deprecation():
            ds = map_stage(ray.data.from_pandas(frames), GroupProbe, compute=ActorPoolStrategy(size=2),
                           batch_size=None, batch_format="pandas",
                           options={"num_cpus": 0.1, "max_restarts": 0, "ray_remote_args_fn": placement})
            out = ds.to_pandas()
        groups = {entry["placement_group_id"] for entry in placement.groups()}
        assert len(groups) == 2  # one per replica: no call of the fn made a group for no actor
        assert set(out["group"]) <= groups and "" not in set(out["group"])
        assert sorted(out["x"]) == list(range(6))
    finally:
        placement.release()
    assert placement.groups() == []


# --- the DAGs' stages ----------------------------------------------------------------------


def _map_ops(ds) -> dict[str, object]:
    ops, stack = {}, [ds._logical_plan.dag]
    while stack:
        op = stack.pop()
        ops[op.name] = op
        stack.extend(op.input_dependencies)
    return ops


def _build(cfg, model_path):
    from pipelines.dag import build_rl_dataset, schedule_groups
    from pipelines.runtime.resources import stage_options

    schedule = schedule_groups(pd.DataFrame({"prompt": ["1+1="], "prompt_id": ["p0"]}), cfg)
    with no_remote_args_deprecation():
        return build_rl_dataset(schedule, cfg, model_path, "no-store", workers=[],
                                remote_args=stage_options(cfg))


def test_the_rl_dag_passes_ray_options_without_deprecated_forms(ray_cluster, tiny_model_path):
    """Building the DAG is where map_batches warns; Train keeps max_restarts 0, generate its CPUs."""
    cfg = load_config(TINY, ["train.steps=1"])
    ops = _map_ops(_build(cfg, tiny_model_path))
    train = next(op for name, op in ops.items() if "AdvantageTrain" in name)
    generate = next(op for name, op in ops.items() if "Generate" in name)
    assert train.ray_remote_args["max_restarts"] == 0
    assert generate.ray_remote_args["num_cpus"] == cfg.rollout.num_cpus
    assert generate.ray_remote_args_fn is None  # one device per engine: no placement group


@needs_vllm
def test_a_tensor_parallel_generate_stage_gets_a_group_per_replica(ray_cluster, tiny_model_path):
    from operators.stages.generate import Generate
    from pipelines.runtime.placement import ReplicaPlacement

    cfg = load_config(TINY, ["train.steps=1", "rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2",
                             "rollout.num_actors=2"])
    generate = next(op for name, op in _map_ops(_build(cfg, tiny_model_path)).items() if "Generate" in name)
    placement = generate.ray_remote_args_fn
    assert isinstance(placement, ReplicaPlacement) and placement.replicas == 2
    assert placement.bundles == [{"CPU": cfg.rollout.num_cpus}]  # CPU: the actor's own; vLLM's mp workers
    assert "num_gpus" not in generate.ray_remote_args
    kwargs = generate.fn_constructor_kwargs
    engine = (dict(kwargs["stages"])[Generate] if "stages" in kwargs else kwargs)["engine_options"]  # GenerateReward
    assert engine["tensor_parallel_size"] == 2 and engine["distributed_executor_backend"] == "mp"


def test_eval_dataset_builds_with_gpus(ray_cluster, tiny_model_path):
    """Public map_batches refuses num_gpus with batch_size=None (one block per generate call)."""
    from pipelines.evaluation.job import eval_dataset
    from pipelines.evaluation.in_training import EvalSettings

    cfg = load_config(TINY, ["eval.data.path=builtin:arithmetic-heldout"])
    with no_remote_args_deprecation():
        ds = eval_dataset([pd.DataFrame({"prompt": ["1+1="]})], tiny_model_path, EvalSettings.of(cfg), True,
                          num_gpus=1)
    generate = next(op for name, op in _map_ops(ds).items() if "Generate" in name)
    assert generate.ray_remote_args["num_gpus"] == 1
