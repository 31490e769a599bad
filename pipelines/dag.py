"""The RL DAG: the prompt schedule as the source, then one `map_batches` per stage (pipelines/stages.py).

    configure_data_context(cfg, replicas)       # Ray Data's globals, once per attempt, before building
    ds = build_dag(schedule, stages(cfg, ...))  # from_pandas(schedule) -> stage -> stage -> ...
    for row in iter_steps(ds): ...              # one row of metrics + rollouts per train step

The only loop is the weight channel (train -> policy store -> generate), outside the DAG.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import pandas as pd
import ray
from ray.data.context import DEFAULT_TARGET_MAX_BLOCK_SIZE

from pipelines.config.job import JobConfig
from pipelines.runtime.placement import ReplicaPlacement, drop_remote_args_probes, map_stage
from pipelines.runtime.rollout_settings import uses_in_flight
from pipelines.stages import Stage, replica_placement, stages


def schedule_groups(prompts: pd.DataFrame, cfg: JobConfig) -> list[pd.DataFrame]:
    """Assign prompts to (step, slot) in epoch order; one DataFrame per generate call.

    Each frame becomes one block of the source, so no generate call spans two steps."""
    steps, per_step, per_call = cfg.train.steps, cfg.generated_groups_per_step(), cfg.rollout.groups_per_call
    total = steps * per_step
    if prompts.empty:
        raise ValueError("no prompts to schedule")  # validate_prompts refuses an empty dataset before this
    # One shuffled copy per epoch the job reaches: ceil(total / rows) of them, not one per group.
    order, epoch, scheduled = [], 0, 0
    while scheduled < total:
        epoch_rows = prompts.sample(frac=1.0, random_state=cfg.data.seed + epoch) if cfg.data.shuffle else prompts
        order.append(epoch_rows.assign(epoch=epoch))
        scheduled += len(epoch_rows)
        epoch += 1
    table = pd.concat(order, ignore_index=True).iloc[:total].copy()
    table["train_step"] = table.index // per_step
    table["group_uid"] = [f"s{step + 1:06d}-g{index % per_step:04d}" for index, step in enumerate(table["train_step"])]
    return [table.iloc[start:start + per_call].reset_index(drop=True) for start in range(0, total, per_call)]


# How long one round of Ray Data's scheduling loop waits for tasks to finish (Ray's default: 0.1 s).
SCHEDULING_WAIT_S = 0.01


def shorten_scheduling_wait(seconds: float = SCHEDULING_WAIT_S) -> None:
    """Ray Data's streaming executor calls ray.wait(every active task, num_returns=all, timeout=0.1 s)
    each round. The RL DAG always has a task that waits for long (a generate call held by the staleness
    gate, the Train stage's calls), so every round lasts the whole timeout, and each hop between stages
    (a block handed on, the next call dispatched) waits for the next round: up to 100 ms, on the loop's
    critical path. 10 ms rounds cost the driver ~1-4 ms of CPU each (measured: benchmarks/loop_latency.py).

    Private API: `WAIT_FOR_TASK_COMPLETION_TIMEOUT_S` is a module constant of Ray Data's executor (Ray
    2.60, read at each call), with no public setting; left alone if a Ray version lacks it.
    """
    from ray.data._internal.execution import streaming_executor_state

    if hasattr(streaming_executor_state, "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S"):
        streaming_executor_state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = seconds


def drop_object_store_budget(ctx: ray.data.DataContext) -> None:
    """Run the RL DAG without Ray Data's ResourceBudgetBackpressurePolicy.

    That policy gives each operator a budget of object-store memory for the outputs of its tasks in
    flight; while a long call runs (a train step inside the Train stage's call, a generate call held by the
    staleness gate) it dispatches nothing more to the operator, so a group that is ready waits for the
    call ahead of it to end (measured in benchmarks/loop_latency.py). The RL DAG does not need it: the
    staleness gate bounds what is in flight (at most max_staleness + 1 steps of groups), every stage is a
    fixed-size actor pool (no CPU budget to keep), and the prompt schedule is a small in-memory table. The
    other policies (concurrency caps, downstream capacity) stay.

    Private API: the config key and the policy classes are Ray Data internals (Ray 2.60); if they move,
    the DAG keeps Ray's defaults.
    """
    try:
        from ray.data._internal.execution import backpressure_policy as policies
    except ImportError:
        return
    default = getattr(policies, "ENABLED_BACKPRESSURE_POLICIES", None)
    key = getattr(policies, "ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY", None)
    if default is None or key is None:
        return
    ctx.set_config(key, [policy for policy in default if policy.__name__ != "ResourceBudgetBackpressurePolicy"])


def configure_data_context(cfg: JobConfig, replicas: ReplicaPlacement | None = None) -> None:
    """Set Ray Data's process-wide settings for the RL DAG: call it once per attempt, before building the
    DAG (a Dataset takes a copy of the current DataContext when it is made). `replicas`: the generate
    actors' placement groups, if any (replica_placement(cfg)). Why each setting: beside it."""
    in_flight = uses_in_flight(cfg.rollout)
    ctx = ray.data.DataContext.get_current()
    # Call-synchronous: keep the order (a reordered stream blocks generate heads-of-line at staleness 0).
    # In flight: calls run side by side in one actor, so nothing blocks; keeping the order would hold every
    # group of a later call until the earlier calls finish, the very wait in-flight generation removes.
    ctx.execution_options.preserve_order = not in_flight
    # In flight: each group Generate yields becomes its own block and leaves at once (Ray Data otherwise
    # coalesces a call's output up to this size, i.e. until the call ends).
    ctx.target_max_block_size = 1 if in_flight else DEFAULT_TARGET_MAX_BLOCK_SIZE
    # Ray Data's progress bars and start-of-execution banner stay off: the job prints its own progress
    # (pipelines/tracking/progress.py); STREAMRL_RAY_PROGRESS=1 shows the bars.
    ctx.enable_progress_bars = os.environ.get("STREAMRL_RAY_PROGRESS") == "1"
    ctx.print_on_execution_start = False
    if not ctx.enable_progress_bars:  # Ray Data warns that the bars are off, which is this line's choice
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # Ray Data's high-memory detector compares each actor's memory with a 0-byte request and suggests a
    # `memory=` option, 30 s into every job: the job sizes memory itself (pipelines/runtime/memory.py,
    # `streamrl validate`), so the warning only confuses. Its other detectors (hanging tasks) stay on.
    ctx.issue_detectors_config.high_memory_detector_config.detection_time_interval_s = -1
    shorten_scheduling_wait()  # 10 ms rounds: a hop between stages waits less (see the function)
    drop_object_store_budget(ctx)  # a ready group is not held behind a long call (see the function)
    if replicas is not None:  # no extra placement group for Ray Data's memory probe (runtime/placement.py)
        drop_remote_args_probes(ctx)


def build_dag(schedule: list[pd.DataFrame], stage_list: list[Stage]) -> ray.data.Dataset:
    """The DAG: the schedule (one block per generate call), then each stage's `map_batches` in order.
    Mutates nothing global: configure_data_context comes first."""
    ds = ray.data.from_pandas(schedule)
    for stage in stage_list:
        ds = map_stage(ds, stage.fn, fn_constructor_kwargs=stage.kwargs, compute=stage.compute,
                       batch_size=stage.batch_size, batch_format=stage.batch_format, options=stage.options)
    return ds


def build_rl_dataset(
    schedule: list[pd.DataFrame], cfg: JobConfig, model_path: str, store, workers,
    remote_args: dict[str, dict] | None = None, first_step: int = 0, checkpoint_options: dict | None = None,
    critics=None, replicas: ReplicaPlacement | None = None,
) -> ray.data.Dataset:
    """configure_data_context, then build_dag of `stages(cfg, ...)` (see pipelines/stages.py for the
    arguments): the whole DAG in one call, for tests and benchmarks that run it outside a job.
    `replicas`: made here if not given (then they last until the driver exits)."""
    replicas = replicas or replica_placement(cfg)
    configure_data_context(cfg, replicas)
    return build_dag(schedule, stages(cfg, model_path, store, workers, remote_args, first_step, checkpoint_options,
                                      critics, replicas))


def iter_steps(ds: ray.data.Dataset) -> Iterator[dict]:
    # prefetch 0: the consumer must never hold a step that training is waiting to finish
    for batch in ds.iter_batches(batch_size=None, batch_format="pandas", prefetch_batches=0):
        yield from batch.to_dict("records")
