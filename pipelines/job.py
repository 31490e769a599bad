"""The GRPO job: one Ray Data streaming DAG, prompts -> generate -> reward -> advantage -> train.

    schedule (prompt groups, each tagged with the train step it will feed)
      -> Generate   actor pool; admission-gated on the policy store (>= step - max_staleness)
      -> Reward     actor pool; weighted reward functions, failures contained (reward.placement
                    "generate": in the generate actors instead, one stage)
      -> [Value]    PPO with a critic: per-token values from the critic store (its own DeepSpeed group)
      -> Advantage  group-relative estimator, or GAE from the values   } one stage, one actor
      -> Train      buffers a step's groups, steps the DeepSpeed group,  } (operators/chain.py)
                    publishes weights
      -> one row of metrics + rollouts per step -> MLflow, terminal
    beside it (eval set): an evaluator actor scores held-out prompts with retained policy versions

The only loop is the weight channel (train -> policy store -> generate).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import traceback
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import ray
from ray.data import ActorPoolStrategy
from ray.data.context import DEFAULT_TARGET_MAX_BLOCK_SIZE

from operators.advantage import Advantage
from operators.durable import MIB, free_bytes, space_problem
from operators.generate import Generate
from operators.ref_logprob import RefLogprob
from operators.reward import Reward
from operators.train import Train
from operators.value import Value
from pipelines.recovery.checkpoint import CRITIC_DIR, LEDGER, CheckpointDir, StepCheckpoints, dataset_digest, next_run_sequence
from pipelines.config.schema import ConfigError, JobConfig, ModelConfig
from pipelines.data.datasets import load_prompts
from pipelines.evaluation.in_training import InTrainingEval, load_eval_prompts
from operators.chain import Chain
from pipelines.tracking.tracker import NullTracker, Tracker, announce_run
from pipelines.data.models import resolve_job_models, resolve_model_path
from pipelines.runtime.nodes import NodeWatch, alive_node_ids, confirm_lost_nodes, placement_line, replan
from pipelines.runtime.placement import (
    ReplicaPlacement, drop_remote_args_probes, engine_bundles, map_stage, vllm_executor_backend,
)
from pipelines.tracking.policy_model import log_final_policy
from pipelines.runtime.policy_store import create_policy_store
from pipelines.recovery.preemption import Preempted, Preemption
from pipelines.tracking.progress import Progress
from pipelines.runtime.resources import DAG_HELPER_CPUS, stage_options
from pipelines.recovery.resume import (
    AttemptFailed, check_can_resume, describe_failure, is_disk_full_failure, is_process_death, resolve_run,
    run_file_info,
)
from pipelines.recovery.run_lease import LeaseHeld, RunLease
from pipelines.recovery.step_log import EvalRows, StepLog, write_dropped
from pipelines.tracking.timeline import overlap_report
from pipelines.runtime.trainer_group import (
    advantage_options, critic_model_path, start_critic_group, start_trainer_group, stop_trainer_group, train_options,
)


@dataclass
class JobResult:
    run_id: str | None
    metrics: pd.DataFrame  # one row per train step
    checkpoint: Path | None  # the final checkpoint (a Hugging Face folder plus the resumable state)
    model_path: str
    trainer_placement: list[dict] = field(default_factory=list)
    output_dir: Path = Path(".")
    resume_id: str | None = None  # what `--resume` takes: the MLflow run id, or a local id when untracked
    eval_metrics: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per evaluated policy version
    # In-flight engines: one row per weight update of a generator (pull_s and prepare_s overlapped decoding;
    # pause_s is the stall: drain_s + load_s + resume), from every attempt.
    weight_updates: pd.DataFrame = field(default_factory=pd.DataFrame)


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
    table["group_uid"] = [f"s{step:06d}-g{index % per_step:04d}" for index, step in enumerate(table["train_step"])]
    return [table.iloc[start:start + per_call].reset_index(drop=True) for start in range(0, total, per_call)]


def engine_options(cfg: JobConfig, engine: str | None = None, in_flight: bool = False,
                   replica_group: bool = False) -> dict:
    """Constructor options of `engine` (default: the configured rollout engine; `in_flight`: its async form).
    `replica_group`: the engine runs in a generate replica's placement group (replica_placement), whose GPU
    bundles vLLM's Ray executor fills; otherwise a tensor-parallel engine uses the GPUs its actor holds."""
    options = {"torch_threads": cfg.rollout.torch_threads, "trust_remote_code": cfg.model.trust_remote_code}
    if (engine or cfg.rollout.engine) == "vllm":
        options.update(cfg.rollout.vllm.model_dump(), seed=cfg.train.seed)
        if in_flight:
            options["max_num_seqs"] = cfg.rollout.max_seqs_in_flight
        backend = vllm_executor_backend(cfg.rollout.vllm.tensor_parallel_size,
                                        cfg.rollout.num_gpus if replica_group else 0)
        if backend is not None:
            options["distributed_executor_backend"] = backend
    return options


def pool_size(low: int, high: int) -> dict:
    """ActorPoolStrategy's size arguments: a fixed pool, or Ray Data's autoscaling pool from `low` to `high`
    (it starts `low` actors, adds one while every actor is busy and the cluster has room, and removes idle
    ones; a new generate actor pulls the newest policy version before its first group)."""
    return {"size": low} if low == high else {"min_size": low, "max_size": high, "initial_size": low}


def replica_placement(cfg: JobConfig) -> ReplicaPlacement | None:
    """A placement group per generate actor when one engine spans several devices (None otherwise: a
    one-device engine is one actor's reservation, which Ray already keeps on one node). Whoever runs the
    DAG calls `release()` when it ends (_run_attempt)."""
    rollout = cfg.rollout
    if rollout.vllm.tensor_parallel_size == 1:
        return None
    return ReplicaPlacement(
        engine_bundles(rollout.vllm.tensor_parallel_size, rollout.num_cpus, rollout.num_gpus, rollout.resources),
        replicas=rollout.min_actors,  # a count: a range needs tensor_parallel_size 1 (config)
    )


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


def build_rl_dataset(
    schedule: list[pd.DataFrame], cfg: JobConfig, model_path: str, store: str, workers,
    remote_args: dict[str, dict] | None = None, first_step: int = 0, checkpoint_options: dict | None = None,
    critics=None, replicas: ReplicaPlacement | None = None,
) -> ray.data.Dataset:
    """The DAG. `remote_args` adds Ray options per stage ("generate", "reward", "reference"), e.g.
    {"generate": {"num_gpus": 1}} or {"generate": {"resources": {"sim_gpu": 4}}}. `schedule` starts at
    `first_step`; `checkpoint_options` (see operators.train.Train) turns checkpoints on. `critics`: the
    critic group (start_critic_group) when the config has a critic. `replicas`: the generate actors'
    placement groups (replica_placement(cfg)) when an engine spans several devices; the caller releases
    them when the DAG ends (made here if not given: then they last until the driver exits)."""
    remote_args = remote_args or {}
    replicas = replicas or replica_placement(cfg)
    generate_options = {"num_cpus": cfg.rollout.num_cpus, **remote_args.get("generate", {})}
    if replicas is not None:  # the group holds the engine's GPUs (vLLM's workers take them), the actor none
        generate_options.update(num_gpus=None, ray_remote_args_fn=replicas)
    in_flight, calls = cfg.rollout.uses_in_flight(), cfg.rollout.actor_calls()
    queued = calls if in_flight else 2
    ctx = ray.data.DataContext.get_current()
    # Call-synchronous: keep the order (a reordered stream blocks generate heads-of-line at staleness 0).
    # In flight: calls run side by side in one actor, so nothing blocks; keeping the order would hold every
    # group of a later call until the earlier calls finish, the very wait in-flight generation removes.
    ctx.execution_options.preserve_order = not in_flight
    # In flight: each group Generate yields becomes its own block and leaves at once (Ray Data otherwise
    # coalesces a call's output up to this size, i.e. until the call ends).
    ctx.target_max_block_size = 1 if in_flight else DEFAULT_TARGET_MAX_BLOCK_SIZE
    ctx.enable_progress_bars = os.environ.get("STREAMRL_RAY_PROGRESS") == "1"
    ctx.print_on_execution_start = False
    shorten_scheduling_wait()
    drop_object_store_budget(ctx)
    if replicas is not None:
        drop_remote_args_probes(ctx)
    ds = ray.data.from_pandas(schedule)
    generate = dict(
        model_path=model_path, engine=cfg.rollout.engine, n=cfg.rollout.n,
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, seed=cfg.train.seed, policy_store=store,
        max_staleness=cfg.train.max_staleness,
        engine_options=engine_options(cfg, in_flight=in_flight, replica_group=replicas is not None),
        in_flight=in_flight, max_seqs_in_flight=cfg.rollout.max_seqs_in_flight,
        partial_rollout=cfg.rollout.partial_rollout, update_when=cfg.rollout.update_when,
        **cfg.prompt_options(),
    )
    if cfg.rollout.environment is not None:  # multi-turn episodes (operators/environment.py)
        env = cfg.rollout.environment
        generate.update(environment=env.name, environment_options=cfg.environment_options(), max_turns=env.max_turns,
                        max_episode_tokens=env.max_episode_tokens)
    reward = dict(
        functions=[(f.name, f.weight) for f in cfg.reward.functions], on_error=cfg.reward.on_error,
        timeout_s=cfg.reward.timeout_s, timestamps=True, limits=cfg.sandbox.limits(),
    )
    # reward.placement "generate": each group is scored in the generate actor that sampled it (one stage,
    # one executor hop less on the loop); "stage": a reward actor pool of its own.
    in_generate = cfg.reward.placement == "generate"
    ds = map_stage(
        ds, GenerateReward if in_generate else Generate,
        fn_constructor_kwargs=dict(stages=[(Generate, generate), (Reward, reward)]) if in_generate else generate,
        # In flight: `calls` calls per actor at once, each in its own thread (the engine runs on the
        # actor's rollout loop, so the calls only wait on it); call-synchronous: one at a time, with the
        # next one already queued at the actor (it starts the moment its version is out, not one executor
        # round trip after the previous call ended).
        compute=ActorPoolStrategy(**pool_size(cfg.rollout.min_actors, cfg.rollout.max_actors),
                                  max_tasks_in_flight_per_actor=queued,
                                  max_concurrent_calls_per_actor=calls if in_flight else None,
                                  enable_true_multi_threading=True if in_flight else None),
        batch_size=None, batch_format="pandas", options=generate_options,
    )
    if not in_generate:
        ds = map_stage(
            ds, Reward, fn_constructor_kwargs=reward, compute=ActorPoolStrategy(size=cfg.reward.num_actors),
            batch_size=None, batch_format="pandas",
            options={"num_cpus": cfg.reward.num_cpus, **remote_args.get("reward", {})},
        )
    if cfg.reference is not None:  # the design's ref_logprob stage: log-probs of a frozen reference policy
        ref = cfg.reference
        ds = map_stage(
            ds, RefLogprob,
            fn_constructor_kwargs=dict(
                model_path=(resolve_model_path(ModelConfig(path=ref.model_path), "reference.model_path")
                            if ref.model_path and ref.model_path != cfg.model.path else model_path),
                temperature=cfg.rollout.temperature, micro_batch_tokens=ref.micro_batch_tokens,
                torch_threads=ref.torch_threads, dtype=ref.dtype, trust_remote_code=cfg.model.trust_remote_code,
            ),
            compute=ActorPoolStrategy(size=ref.num_actors), batch_size=None, batch_format="pandas",
            options={"num_cpus": ref.num_cpus, **remote_args.get("reference", {})},
        )
    if critics is not None:
        ds = map_stage(
            ds, Value,
            fn_constructor_kwargs=dict(model_path=critics.model_path, value_store=critics.store_name,
                                       torch_threads=cfg.critic.torch_threads,
                                       trust_remote_code=cfg.model.trust_remote_code),
            compute=ActorPoolStrategy(size=1), batch_size=None, batch_format="pandas",
            options={"num_cpus": cfg.critic.value_num_cpus},
        )
    # Advantage runs in the Train stage's actor: one executor trip less on the loop (operators/chain.py).
    # Its state (buffered groups, the ledger) dies with it: no silent restart; the job restarts from the
    # last checkpoint instead (run_job).
    return map_stage(
        ds, AdvantageTrain,
        fn_constructor_kwargs=dict(stages=[
            (Advantage, advantage_options(cfg)),
            (Train, dict(
                workers=workers, groups_per_step=cfg.train.groups_per_step, total_steps=cfg.train.steps - first_step,
                generated_per_step=cfg.generated_groups_per_step(), dynamic_sampling=cfg.algorithm.dynamic_sampling,
                first_step=first_step, success_threshold=cfg.reward.success_threshold, **train_options(cfg),
                critics=list(critics or []), **(checkpoint_options or {}),
            )),
        ]),
        # Calls side by side (threads): the next step's groups are taken in while a step trains, so that
        # step starts the moment this one ends (operators.train.Train is safe for it).
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=TRAIN_CALLS,
                                  max_concurrent_calls_per_actor=TRAIN_CALLS, enable_true_multi_threading=True),
        batch_size=None, batch_format="pandas", options={"num_cpus": DAG_HELPER_CPUS, "max_restarts": 0},
    )


# Calls the last stage runs at once: one trains, the others take in groups meanwhile.
TRAIN_CALLS = 4


class AdvantageTrain(Chain):
    """The RL DAG's last stage: Advantage, then Train, in one actor."""


class GenerateReward(Chain):
    """The RL DAG's first stage with reward.placement "generate": Generate, then Reward, in one actor."""


def iter_steps(ds: ray.data.Dataset) -> Iterator[dict]:
    # prefetch 0: the consumer must never hold a step that training is waiting to finish
    for batch in ds.iter_batches(batch_size=None, batch_format="pandas", prefetch_batches=0):
        yield from batch.to_dict("records")


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


@contextlib.contextmanager
def ray_session(cfg: JobConfig):
    """Use the caller's Ray (a test, a notebook), else start or join one for this job."""
    if ray.is_initialized():
        yield
        return
    init_ray(
        cfg.ray.address, cfg.ray.num_cpus, cfg.ray.object_store_memory_mb,
        cfg.ray.include_dashboard, cfg.ray.dashboard_host,
    )
    try:
        yield
    finally:
        ray.shutdown()


class JobFailed(RuntimeError):
    """The job stopped before its last step; `run_id` resumes it (`streamrl run ... --resume RUN_ID`)."""

    def __init__(self, message: str, run_id: str, resume_step: int, interrupted: bool = False,
                 preempted: bool = False):
        super().__init__(message)
        self.run_id, self.resume_step, self.interrupted = run_id, resume_step, interrupted
        self.preempted = preempted  # a graceful stop on SIGTERM (pipelines/recovery/preemption.py)


def run_job(cfg: JobConfig, echo: Callable[[str], None] = print, resume: str | None = None) -> JobResult:
    """Run (or, with `resume` = a run id or 'latest', continue) a job. Raises ConfigError for bad
    input before anything starts, JobFailed when it stops early."""
    output_dir = Path(cfg.output_dir).resolve()
    model_path = resolve_job_models(cfg, echo)  # downloads or converts what it must, once; ConfigError if it cannot
    prompts, source = load_prompts(cfg.data)
    prompts = checked_prompts(prompts, cfg, model_path, echo)
    if not ray.is_initialized() and cfg.ray.address is None and not os.environ.get("RAY_ADDRESS"):
        check_object_store(cfg, model_path, cfg.ray.object_store_memory_mb, "local")  # before the MLflow run
    schedule = schedule_groups(prompts, cfg)
    digest = dataset_digest(prompts)
    held_out = load_eval_prompts(cfg, model_path, echo) if cfg.eval is not None else None
    checkpoint = None
    lease = None
    if resume is not None:
        run_id = resolve_run(output_dir, resume)
        run_dir = CheckpointDir.of_run(output_dir, run_id)
        lease = take_lease(run_dir, echo)  # before the folder is touched: one writer per run
        for partial in run_dir.clean_partial():
            echo(f"streamrl: removed {partial.name}, a checkpoint a dead job had not finished writing")
        checkpoint = run_dir.latest_valid(echo)
        try:
            check_can_resume(cfg, run_dir, checkpoint, schedule, digest)
        except ConfigError:
            lease.release()
            raise
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        tracker = (Tracker(cfg, prompts, source, resume_run_id=resume and run_id, echo=echo)
                   if cfg.tracking.enabled else NullTracker())
    except Exception as err:
        if resume is None:
            raise
        lease.release()
        raise ConfigError([("--resume", f"cannot reopen MLflow run {run_id} at {cfg.tracking_uri()} "
                                        f"({describe_failure(err)}); check tracking.uri and tracking.experiment, "
                                        "or set tracking.enabled: false to resume without MLflow")]) from None
    if resume is None:
        run_id = tracker.run_id or f"local-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        run_dir = CheckpointDir.of_run(output_dir, run_id)
        run_dir.write_run_file(run_file_info(cfg, run_id, digest, time.time(), next_run_sequence(output_dir)))
        lease = take_lease(run_dir, echo)
    start = checkpoint.step if checkpoint else 0
    echo(f"streamrl: {cfg.train.steps} steps x {cfg.train.groups_per_step} groups x {cfg.rollout.n} samples, "
         f"max_staleness={cfg.train.max_staleness}, model {model_path}")
    echo(announce_run(tracker))
    if resume is not None:
        where = f"checkpoint {checkpoint.path} (step {start})" if checkpoint else "the start (no checkpoint yet)"
        echo(f"streamrl: resuming run {run_id} from {where}")
        tracker.set_tags({"resume.from_step": start})
    run_info = {"run_id": run_id, "dataset": source, "dataset_digest": digest, "model_path": model_path}
    if held_out is not None:
        tracker.log_dataset(held_out[0], held_out[1], "eval")
    rows, status, restarts, placement, loads = [], "FAILED", 0, [], []
    # Step rows and evaluations reach MLflow once a checkpoint covers them (pipelines/recovery/step_log.py).
    steps = StepLog(tracker, committed=start, attempt=run_dir.next_attempt(),
                    retrained_dir=output_dir / "retrained" / run_id, echo=echo)
    tracker.set_tags({"attempts": steps.attempt})
    if resume is not None:  # steps the dead driver had not logged when its checkpoint was written
        _say_backfilled(steps.backfill(checkpoint, steps.attempt - 1, tracker.train_steps_logged()), echo)
    evaluation = EvalPlan(cfg, held_out[0] if held_out else None, model_path, tracker, output_dir / "eval" / run_id,
                          log=EvalRows(steps))
    preemption = Preemption(cfg.train.on_preempt, cfg.train.preempt_grace_s, echo)
    try:
        # After Ray's start: ray.init sets a SIGTERM handler of its own (sys.exit), which ours replaces.
        with ray_session(cfg), preemption:
            check_object_store(cfg, model_path)  # the cluster's real object stores, before any actor starts
            progress = Progress(cfg.train.steps, echo, first_step=start)
            stop = preemption.stop_request()
            attempt_cfg = cfg  # after a node loss: what fits the nodes left (fewer generate actors)
            while True:
                known_nodes = alive_node_ids()
                try:
                    placement = _run_attempt(attempt_cfg, schedule, model_path, tracker, checkpoint, run_dir, run_info,
                                             rows, progress, evaluation, loads, steps, stop, lease)
                    break
                except Exception as err:
                    full = is_disk_full_failure(err)
                    if not (is_process_death(err) or full) or restarts >= cfg.train.max_restarts:
                        raise
                    if full:  # a full disk may clear (another job's files): wait for room, then retry
                        wait_for_space(run_dir, cfg.train.disk_full_wait_s, echo, err)
                    restarts += 1
                    if confirm_lost_nodes(known_nodes, echo):  # re-plan on the nodes left, or wait for some
                        attempt_cfg = replan(cfg, echo)
                    checkpoint = run_dir.latest_valid(echo)
                    run_dir.clean_partial()
                    start = checkpoint.step if checkpoint else 0
                    rows[:] = [row for row in rows if row["step"] < start]  # steps after it are trained again
                    dropped = steps.drop(start)
                    _say_backfilled(steps.backfill(checkpoint, steps.attempt), echo)
                    write_dropped(dropped, output_dir / "dropped" / run_id, steps.attempt, tracker)
                    evaluation.forget_after(start)
                    steps.attempt = run_dir.next_attempt()
                    echo(f"streamrl: {'the disk was full' if full else 'a process died'} ({err}); restarting the "
                         "trainer group and the DAG "
                         f"from step {start} (restart {restarts}/{cfg.train.max_restarts}, attempt {steps.attempt}; "
                         f"{len(dropped)} step(s) trained after that checkpoint are trained again)")
                    tracker.set_tags({"restarts": restarts, "attempts": steps.attempt})
                    progress.restart(start)
        if rows:
            overlap = overlap_report([row["timeline"] for row in rows])
            tracker.log_step({"step": cfg.train.steps, **{f"job_{k}": v for k, v in overlap.items()},
                              **weight_update_summary(loads)})
            echo(f"streamrl: overlap efficiency {overlap['overlap_efficiency']:.2f} "
                 f"(trainer idle {overlap['trainer_idle_fraction']:.0%}, "
                 f"generators idle {overlap['generator_idle_fraction']:.0%} over {overlap['window_s']:.0f}s)")
            if loads:
                summary = weight_update_summary(loads)
                echo(f"streamrl: {len(loads)} weight updates in flight: pause {summary['job_weight_pause_s_median'] * 1e3:.0f} ms "
                     f"median ({summary['job_weight_pause_s_max'] * 1e3:.0f} ms max); pull + prepare "
                     f"{summary['job_weight_pull_prepare_s_median'] * 1e3:.0f} ms median while decoding went on")
        final = run_dir.latest_valid(echo, hashes=False)
        if cfg.tracking.log_model:
            log_final_policy(tracker, final, cfg, echo)
        status = "FINISHED"
    except Preempted as stopped:
        status = "KILLED"
        preemption.disarm()
        tracker.set_tags({"stopped_by": "preemption"})
        step = _resume_step(run_dir)
        raise JobFailed(f"{stopped} (the last checkpoint is at step {step})", run_id, step, True, True) from None
    except KeyboardInterrupt:
        status = "KILLED"
        step = _resume_step(run_dir)
        if preemption.grace_expired:  # a graceful stop that ran out of time: still a preemption
            tracker.set_tags({"stopped_by": "preemption"})
            raise JobFailed(f"stopped on SIGTERM before the step in progress ended (train.preempt_grace_s); "
                            f"the last checkpoint is at step {step}", run_id, step, True, True) from None
        raise JobFailed(f"interrupted at step {step}", run_id, step, True) from None
    except ConfigError:
        raise
    except Exception as err:
        step = _resume_step(run_dir)
        summary = str(err) if isinstance(err, AttemptFailed) else describe_failure(err)
        raise JobFailed(f"{summary} (the last checkpoint is at step {step})", run_id, step) from err
    finally:
        preemption.disarm()
        _drop_uncommitted(steps, run_dir, output_dir / "dropped" / run_id, tracker, echo)
        tracker.close(status, timeout_s=preemption.remaining_s() if preemption.requested_at is not None else None)
        # what the Train operator kept past checkpoint_keep while its upload was on the way, now delivered
        run_dir.prune(cfg.train.checkpoint_keep, require_uploaded=cfg.tracking.enabled)
        lease.release()
    echo(f"streamrl: done; checkpoint {final.path if final else None}; MLflow run {tracker.run_id}")
    return JobResult(tracker.run_id, pd.DataFrame(rows), final.path if final else None, model_path, placement,
                     output_dir, resume_id=run_id, eval_metrics=evaluation.table(), weight_updates=pd.DataFrame(loads))


def weight_update_summary(loads: list[dict]) -> dict[str, float]:
    """Job metrics of the in-flight engines' weight updates (none for call-synchronous engines)."""
    if not loads:
        return {}
    import numpy as np

    pause = np.array([load["pause_s"] for load in loads])
    overlapped = np.array([load["pull_s"] + load["prepare_s"] for load in loads])
    return {"job_weight_updates": len(loads), "job_weight_pause_s_median": float(np.median(pause)),
            "job_weight_pause_s_max": float(pause.max()), "job_weight_pause_s_total": float(pause.sum()),
            "job_weight_pull_prepare_s_median": float(np.median(overlapped))}


def checked_prompts(prompts: pd.DataFrame, cfg: JobConfig, model_path: str, echo: Callable[[str], None]) -> pd.DataFrame:
    """Refuse (or drop, with data.invalid_prompts: drop) empty, too-long and duplicate-id prompts."""
    from pipelines.data.prompt_checks import validate_prompts

    kept, dropped = validate_prompts(prompts, cfg, model_path)
    for kind, ids in dropped.items():
        if ids:
            echo(f"streamrl: dropped {len(ids)} {kind.replace('_', ' ')} prompt(s) (data.invalid_prompts: drop), "
                 f"e.g. {', '.join(map(str, ids[:5]))}")
    return kept


def check_object_store(cfg: JobConfig, model_path: str, store_mb: float | None = None, where: str = "") -> None:
    """Refuse (ConfigError) an object store too small for the weight channel (pipelines/runtime/memory.py).
    `store_mb` None: the smallest object store of the connected cluster's live nodes."""
    from pipelines.runtime.memory import object_store_problem

    if store_mb is None:
        sizes = [node["Resources"].get("object_store_memory", 0) / 2**20 for node in ray.nodes() if node.get("Alive")]
        if not sizes:
            return
        store_mb, where = min(sizes), "smallest node's"
    problem = object_store_problem(cfg, model_path, store_mb, where)
    if problem:
        raise ConfigError([("ray.object_store_memory_mb", problem.split(": ", 1)[1])])


def _say_backfilled(logged: list[int], echo) -> None:
    if logged:
        echo(f"streamrl: logged step(s) {', '.join(str(step + 1) for step in logged)} from the checkpoint "
             "(their rows had not reached MLflow before the process that trained them ended)")


def _drop_uncommitted(steps: StepLog, run_dir: CheckpointDir, folder: Path, tracker, echo) -> None:
    """At the end of a job: what it trained after its last checkpoint stays out of the metric history (a
    resume trains it again), kept as an artifact instead. A finished job has nothing there."""
    dropped = steps.drop(_resume_step(run_dir))
    if dropped:
        write_dropped(dropped, folder, steps.attempt, tracker)
        echo(f"streamrl: {len(dropped)} step(s) trained after the last checkpoint are not in the MLflow metric "
             f"history (a resume trains them again); their rows are the run's artifact "
             f"dropped/attempt_{steps.attempt}.jsonl")


def take_lease(run_dir: CheckpointDir, echo) -> RunLease:
    """The run's lease (pipelines/recovery/run_lease.py); ConfigError when another live process writes the run."""
    try:
        return RunLease(run_dir.root, echo=echo).acquire()
    except LeaseHeld as err:
        raise ConfigError([("--resume", str(err))]) from None


def wait_for_space(run_dir: CheckpointDir, wait_s: float, echo, err: BaseException) -> None:
    """After an attempt failed on a full disk: wait up to `wait_s` for room for a checkpoint (the newest
    one's size), saying what is needed; raise `err` again if it does not come."""
    needed = max(run_dir.needed_bytes(), MIB)
    problem = space_problem(run_dir.root, needed, "the next checkpoint")
    if problem is None:
        return
    echo(f"streamrl: disk full: {problem}; waiting up to {wait_s:g}s (train.disk_full_wait_s) for room, then "
         "restarting from the last checkpoint")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0)))
        if space_problem(run_dir.root, needed, "the next checkpoint") is None:
            echo(f"streamrl: {free_bytes(run_dir.root) / MIB:,.0f} MiB free at {run_dir.root} again")
            return
    raise err


def _resume_step(run_dir: CheckpointDir) -> int:
    checkpoint = run_dir.latest_valid(lambda _: None, hashes=False)
    return checkpoint.step if checkpoint else 0


class EvalPlan:
    """Which policy versions the job evaluates on held-out prompts, and what was logged, across attempts."""

    def __init__(self, cfg: JobConfig, prompts: pd.DataFrame | None, model_path: str, tracker, artifacts_dir: Path,
                 log=None):
        """`log`: where evaluations are logged (an EvalRows of the job's StepLog; default `tracker`)."""
        self.cfg, self.prompts, self.model_path, self.tracker = cfg, prompts, model_path, tracker
        self.log = log or tracker
        self.artifacts_dir = artifacts_dir
        self.rows: list[dict] = []  # one per evaluated version, in order
        # A resumed run: the versions its earlier processes evaluated are in MLflow already.
        self.logged = tracker.metric_steps("eval/policy_version") if tracker.resumed and prompts is not None else set()

    def versions(self, first_step: int) -> list[int]:
        """Versions still to evaluate in an attempt that starts at `first_step` (a restart or a resume
        redoes none that was logged)."""
        if self.prompts is None:
            return []
        done = {row["step"] for row in self.rows} | self.logged
        return [v for v in self.cfg.eval.versions(self.cfg.train.steps) if v >= first_step and v not in done]

    def start(self, store_name: str, first_step: int, echo: Callable[[str], None]) -> InTrainingEval | None:
        versions = self.versions(first_step)
        if not versions:
            return None
        options = engine_options(self.cfg, self.cfg.eval.engine)
        return InTrainingEval(self.cfg, self.prompts, self.model_path, options, store_name,
                              versions, self.log, echo, self.rows, self.artifacts_dir)

    def forget_after(self, step: int) -> None:
        """A restart from the checkpoint of `step` steps: the versions after it are other weights now,
        evaluated again."""
        self.rows[:] = [row for row in self.rows if row["step"] <= step]

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)


def _run_attempt(cfg, schedule, model_path, tracker, checkpoint, run_dir, run_info, rows, progress,
                 evaluation: EvalPlan, loads: list[dict], steps: StepLog, stop=None, lease=None) -> list[dict]:
    """One try: a fresh policy store, trainer group and DAG (and evaluator), from `checkpoint`
    (None: step 0). Returns where the trainer ranks ran."""
    first = checkpoint.step if checkpoint else 0
    store_name = f"streamrl-policy-{uuid.uuid4().hex[:8]}"
    store = create_policy_store(store_name, retain=tuple(evaluation.versions(first)))
    evaluator = evaluation.start(store_name, first, progress.echo)
    workers, placement = start_trainer_group(cfg, model_path, store_name)
    critics, value_store, watch = None, None, None
    replicas = replica_placement(cfg)  # the generate actors' placement groups, released below
    try:
        if cfg.critic is not None:  # its own store; version -1 until rank 0 publishes the initialised critic
            value_store_name = f"streamrl-critic-{uuid.uuid4().hex[:8]}"
            value_store = create_policy_store(value_store_name, initial_version=-1)
            critics, _ = start_critic_group(cfg, critic_model_path(cfg, model_path), value_store_name)
        tracker.set_tags({f"trainer.rank{rank['rank']}.node_id": rank["node_id"] for rank in placement})
        if len(ray.nodes()) > 1:  # on a cluster: say where the ranks went (a restart may move them)
            progress.echo(f"streamrl: trainer group placed: {placement_line(placement)}")
        if checkpoint is not None:  # rank 0 publishes the checkpoint's weights before any generator asks
            ray.get([worker.load_checkpoint.remote(str(checkpoint.path), checkpoint.step) for worker in workers]
                    + [critic.load_checkpoint.remote(str(checkpoint.path / CRITIC_DIR), checkpoint.step)
                       for critic in critics or []])
        frames = [frame for frame in schedule if int(frame["train_step"].iloc[0]) >= first]
        options = dict(
            checkpoints=StepCheckpoints(str(run_dir.root), every=cfg.train.checkpoint_every,
                                        keep=cfg.train.checkpoint_keep, hf_export=cfg.train.checkpoint_hf_export,
                                        run_info=run_info, attempt=steps.attempt,
                                        prior_rows=[row for row in checkpoint.step_rows()
                                                    if int(row["step"]) < first] if checkpoint else None,
                                        prune_uploaded_only=cfg.tracking.enabled,
                                        fence=lease.fence if lease is not None else None),
            # each attempt its own folder: a step trained again must not replace a file still to be uploaded
            rollouts_dir=(str(Path(cfg.output_dir).resolve() / "rollouts" / run_dir.root.name / f"attempt_{steps.attempt}")
                          if cfg.tracking.enabled and cfg.tracking.log_rollouts else None),
            prior_ledger=str(checkpoint.path / LEDGER) if checkpoint else None,
            max_nan_skips=cfg.train.max_nan_skips, stop=stop,
        )
        ds = build_rl_dataset(frames, cfg, model_path, store_name, workers, stage_options(cfg),
                              first_step=first, checkpoint_options=options, critics=critics, replicas=replicas)
        failure = None
        watch = NodeWatch(cfg, placement, progress.echo).start()  # ends the attempt if a rank's node is lost
        try:
            for row in iter_steps(ds):
                if lease is not None:
                    lease.check()  # another process took the run: stop before logging anything more
                row = {**row, "attempt": steps.attempt}
                steps.hold(row, int(row["step"]) + 1)
                progress.update(row)
                if row.get("checkpoint_path"):
                    steps.commit(int(row["step"]) + 1)
                    tracker.log_checkpoint(Path(row["checkpoint_path"]), int(row["step"]) + 1)
                    progress.echo(f"streamrl: checkpoint {row['checkpoint_path']} "
                                  f"({row.get('time_checkpoint', 0.0):.1f}s)")
                if row.get("nonfinite_skipped"):
                    progress.echo(f"streamrl: step {int(row['step']) + 1}: the loss was not finite; step skipped, "
                                  "weights unchanged (train.nan_policy: skip)")
                rows.append({k: v for k, v in row.items() if k not in ("rollouts_parquet", "rollouts_path")})
                if evaluator is not None:
                    evaluator.poll()
                if row.get("stopped"):  # a graceful stop: this step is trained and checkpointed
                    raise Preempted(f"stopped on SIGTERM after step {int(row['step']) + 1}, which was "
                                    "trained and checkpointed", finished_step=True)
            if evaluator is not None:  # before the trainer group stops: rank 0 owns the retained weights
                evaluator.finish()
            watch.stop()  # inside the try: an interrupt it already sent lands here
        except KeyboardInterrupt:
            if watch.lost is None:  # Ctrl-C, or the grace period of a stop running out
                raise
            failure = AttemptFailed(watch.lost, watch.lost, process_death=True)
        except Exception as err:  # keep its text, drop its frames (see AttemptFailed)
            failure = AttemptFailed.from_exception(err)
            traceback.clear_frames(err.__traceback__)
    finally:
        if watch is not None:
            watch.stop()
        if evaluator is not None:
            evaluator.close()
        if replicas is not None:  # a restarted attempt makes new ones; these would hold their GPUs till exit
            replicas.release()
        stop_trainer_group(workers)
        try:
            loads.extend(ray.get(store.load_log.remote(), timeout=10))
        except Exception:  # the store died with the attempt: its log is lost, the job is not
            pass
        ray.kill(store)
        if critics is not None:
            stop_trainer_group(critics)
        if value_store is not None:
            ray.kill(value_store)
    if failure is not None:
        del ds
        gc.collect()  # the failed DAG's actor handles sit in reference cycles: free them now
        raise failure
    return placement
