"""Where a DAG stage's actors run: the Ray options of a `map_batches` stage, and a placement group
per generate replica when one vLLM engine spans several GPUs (rollout.vllm.tensor_parallel_size).

Two Ray 2.60 facts shape this module:

- Ray options as loose `map_batches` keywords (`max_restarts=0`, `scheduling_strategy=...`) and
  `ray_remote_args_fn` are deprecated (RayDeprecationWarning; removed in Ray 2.64). What stays
  public is the named parameters (num_cpus, num_gpus, memory, resources, accelerator_type, ...),
  and Ray's native per-actor placement groups (ray-project/ray#64090) are not released yet.
- Public `map_batches` refuses `num_gpus > 0` with `batch_size=None`, and every stage of the RL
  DAG needs `batch_size=None` (one block is one call: a generate call never spans two steps).

So every stage goes through `map_stage`, which calls `Dataset.map_batches_internal`: Ray's
DeveloperAPI without the public method's checks and warnings, the one Ray's own `ray.data.llm`
stages use for the same two reasons. When Ray ships named placement-group parameters, this
function is the one place to change.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray

# map_batches' own named resource parameters (Ray 2.60); anything else is an actor option.
NAMED_RESOURCE_ARGS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "runtime_env",
                       "label_selector", "fallback_strategy", "max_calls")

# Ray puts this marker resource (1000 units) in every bundle of a placement group; each actor or
# task scheduled into the bundle takes 0.001 of it, so a full amount means nothing runs there.
_BUNDLE_MARKER = "bundle_group_{index}_{pg_id}"
_BUNDLE_MARKER_FULL = 1000.0


def on_this_node():
    """A scheduling strategy for the job's own small actors (the policy store, the stop flag): the
    caller's (the driver's) node, so the job loses them only with its driver, never with a node that
    only held generators or a trainer rank (pipelines/runtime/nodes.py restarts the job past such a loss)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def map_stage(ds: ray.data.Dataset, fn, *, options: dict[str, Any] | None = None, **map_kwargs) -> ray.data.Dataset:
    """`ds.map_batches(fn, **map_kwargs)` with Ray `options` per actor: map_batches' named resource
    parameters, actor options such as `max_restarts`, and `ray_remote_args_fn` (a ReplicaPlacement)."""
    options = {key: value for key, value in (options or {}).items() if value is not None}
    named = {key: options.pop(key) for key in NAMED_RESOURCE_ARGS if key in options}
    remote_args_fn = options.pop("ray_remote_args_fn", None)
    return ds.map_batches_internal(fn, **map_kwargs, **named, ray_remote_args_fn=remote_args_fn, **options)


def drop_remote_args_probes(ctx: ray.data.DataContext) -> None:
    """Keep `ray_remote_args_fn` calls to the actors Ray Data starts. Ray Data 2.60's high-memory issue
    detector also calls it once per operator, at the start of execution, only to read a `memory`
    option: a ReplicaPlacement would make one extra placement group (reserving one more engine's GPUs
    for nothing) or hand out a live replica's. The detector only logs a warning; the others stay.

    Semi-private API: `issue_detectors_config` is a DataContext field, its detector classes are Ray
    Data internals; if they move, tests/integration/test_placement.py (groups == replicas) says so."""
    config = getattr(ctx, "issue_detectors_config", None)
    detectors = getattr(config, "detectors", None)
    if detectors is not None:
        config.detectors = [d for d in detectors if d.__name__ != "HighMemoryIssueDetector"]


def engine_bundles(tensor_parallel_size: int, num_cpus: float, num_gpus: float,
                   resources: dict[str, float]) -> list[dict[str, float]]:
    """The bundles of one engine's placement group. GPUs: one bundle per GPU (vLLM's Ray executor
    puts one worker in each and refuses a bundle of more than one GPU); the first bundle also holds
    the generate actor's CPUs and custom resources. CPU: one bundle, the actor's (vLLM's mp workers
    are processes of the actor)."""
    first = {"CPU": num_cpus, **resources}
    if not num_gpus:
        return [first]
    return [{**first, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(tensor_parallel_size - 1)]


def vllm_executor_backend(tensor_parallel_size: int, num_gpus: float) -> str | None:
    """vLLM's distributed executor for a generate replica, named rather than left to vLLM's guess
    (which depends on the GPUs the actor process sees and on Ray being importable): "ray" on GPUs,
    a worker per bundle of the replica's placement group (Ray LLM's choice for TP > 1, cleaned up
    with the group); "mp" on CPU, worker processes of the actor (vLLM's Ray executor has no CPU
    device). None for one device: vLLM's single-process executor, as before."""
    if tensor_parallel_size <= 1:
        return None
    return "ray" if num_gpus else "mp"


class ReplicaPlacement:
    """`ray_remote_args_fn` of the generate stage: each generate actor (replica) is scheduled into a
    placement group of its own that reserves its engine's bundles together on one node
    (STRICT_PACK), with child tasks captured so that vLLM's Ray workers land in the same group.

    Lifecycle (a leaked group holds GPUs):
    - Ray Data calls this once per actor it starts, in the driver. Ray core restarts a crashed actor
      (max_restarts) in the group it had, without a call.
    - A call once `replicas` groups exist means Ray Data is replacing an actor that is gone for good:
      the call hands out a group of this job whose first bundle nothing runs in (the dead actor's,
      with its GPUs still reserved) instead of making one more. Only when none is vacant yet is a new
      group made; `release` removes it with the rest. (A replacement while an earlier replica's
      actor is still being placed could pick that replica's group; the replacement then waits, and
      the job's end still frees both.)
    - Groups are named `<prefix>-<n>`, the prefix unique to one DAG; `release()` removes every group
      of that prefix, found by name in Ray's placement-group table (so copies of this object, which
      Ray Data may make, need no shared state). The job calls it when an attempt ends, whatever the
      outcome. The groups are not detached: if the driver dies first, Ray removes them with the job.
    """

    def __init__(self, bundles: list[dict[str, float]], replicas: int, prefix: str | None = None,
                 strategy: str = "STRICT_PACK"):
        self.bundles = [dict(bundle) for bundle in bundles]
        self.replicas, self.strategy = replicas, strategy
        self.prefix = prefix or f"streamrl-generate-{uuid.uuid4().hex[:8]}"

    def __call__(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = self.groups()
        vacant = self._vacant(groups) if len(groups) >= self.replicas else None
        pg = vacant or ray.util.placement_group(self.bundles, strategy=self.strategy,
                                                name=f"{self.prefix}-{len(groups)}")
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}

    def groups(self) -> list[dict]:
        """This DAG's live groups (Ray's placement-group table entries), oldest first."""
        table = ray.util.placement_group_table().values()
        return sorted((entry for entry in table if entry["name"].startswith(self.prefix + "-")
                       and entry["state"] != "REMOVED"), key=lambda entry: int(entry["name"].rsplit("-", 1)[1]))

    def _vacant(self, groups: list[dict]):
        free = ray.available_resources()
        for entry in groups:
            marker = _BUNDLE_MARKER.format(index=0, pg_id=entry["placement_group_id"])
            if entry["state"] == "CREATED" and free.get(marker, 0.0) >= _BUNDLE_MARKER_FULL:
                return ray.util.get_placement_group(entry["name"])
        return None

    def release(self) -> int:
        """Remove every group of this DAG (killing what still runs in them); returns how many."""
        removed = 0
        for entry in self.groups():
            try:
                ray.util.remove_placement_group(ray.util.get_placement_group(entry["name"]))
                removed += 1
            except ValueError:  # removed meanwhile
                pass
        return removed
