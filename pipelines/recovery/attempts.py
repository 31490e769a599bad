"""The attempts of one run: restarts, resume and preemption handling of a job (pipelines/job.py).

An attempt is one try: a fresh policy store, trainer group and DAG (and evaluator), from the run's last
checkpoint. A process death (an actor, a node) or a full disk ends it; `run_attempts` then restarts
from the last checkpoint, up to train.max_restarts, re-planned on the nodes left after a node loss.
What an attempt trained after its last checkpoint stays out of MLflow's metric history (the next
attempt trains it again; pipelines/recovery/step_log.py) and is kept as an artifact instead.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import ray

from operators.common.durable import MIB, free_bytes, space_problem
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.dag import build_dag, configure_data_context, iter_steps
from pipelines.evaluation.plan import EvalPlan
from pipelines.recovery.checkpoint import CRITIC_DIR, LEDGER, Checkpoint, CheckpointDir, StepCheckpoints
from pipelines.recovery.preemption import Preempted, Preemption, interrupt_main_thread
from pipelines.recovery.resume import AttemptFailed, is_disk_full_failure, is_process_death
from pipelines.recovery.run_lease import LeaseHeld, RunLease
from pipelines.recovery.step_log import StepLog, write_dropped
from pipelines.runtime.nodes import NodeWatch, alive_node_ids, confirm_lost_nodes, placement_line, replan
from pipelines.runtime.policy_store import create_policy_store
from pipelines.runtime.resources import stage_options
from pipelines.runtime.stall import StallReport
from pipelines.runtime.trainer_group import launch_trainer_group, start_critic_group, stop_trainer_group
from pipelines.runtime.trainer_settings import critic_model_path
from pipelines.stages import replica_placement, stages
from pipelines.tracking.progress import Progress
from pipelines.tracking.startup import Phases


@dataclass
class Run:
    """One run of a job across its attempts: what run_job prepared (pipelines/job.py) and what its attempts
    add up to."""

    cfg: JobConfig
    model_path: str
    schedule: list[pd.DataFrame]
    tracker: Any  # pipelines.tracking.tracker.Tracker, or NullTracker
    run_id: str
    run_dir: CheckpointDir
    run_info: dict
    lease: RunLease
    steps: StepLog  # step rows and evaluations reach MLflow once a checkpoint covers them
    evaluation: EvalPlan
    echo: Callable[[str], None]
    checkpoint: Checkpoint | None = None  # where the next attempt starts (None: step 0)
    rows: list[dict] = field(default_factory=list)  # one per trained step, across attempts
    loads: list[dict] = field(default_factory=list)  # the in-flight engines' weight updates, every attempt
    placement: list[dict] = field(default_factory=list)  # where the last attempt's trainer ranks ran
    restarts: int = 0
    phases: Phases = field(default_factory=Phases)  # the start-up's phases, said at the end (run_job sets it)
    overlap: dict | None = None  # the steps' overlap report (pipelines/tracking/timeline.py), set by report()

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir).resolve()

    @property
    def start(self) -> int:
        return self.checkpoint.step if self.checkpoint else 0


def run_attempts(run: Run, preemption: Preemption) -> None:
    """Attempts until one trains the last step, in the job's Ray session. A process death or a full disk
    restarts from the last checkpoint (up to train.max_restarts); anything else, or one restart too many,
    is raised. `preemption`: the job's SIGTERM handling; its stop request reaches the Train operator."""
    cfg, echo, run_dir, steps = run.cfg, run.echo, run.run_dir, run.steps
    progress = Progress(cfg.train.steps, echo, first_step=run.start)
    stop = preemption.stop_request()
    attempt_cfg = cfg  # after a node loss: what fits the nodes left (fewer generate actors)
    while True:
        known_nodes = alive_node_ids()
        try:
            run.placement = run_attempt(run, attempt_cfg, progress, stop)
            return
        except Exception as err:
            full = is_disk_full_failure(err)
            if not (is_process_death(err) or full) or run.restarts >= cfg.train.max_restarts:
                raise
            if full:  # a full disk may clear (another job's files): wait for room, then retry
                wait_for_space(run_dir, cfg.train.disk_full_wait_s, echo, err)
            run.restarts += 1
            if confirm_lost_nodes(known_nodes, echo):  # re-plan on the nodes left, or wait for some
                attempt_cfg = replan(cfg, echo)
            run.checkpoint = run_dir.latest_valid(echo)
            run_dir.clean_partial()
            start = run.start
            run.rows[:] = [row for row in run.rows if row["step"] <= start]  # steps after it are trained again
            dropped = steps.drop(start)
            say_backfilled(steps.backfill(run.checkpoint, steps.attempt), echo)
            write_dropped(dropped, run.output_dir / "dropped" / run.run_id, steps.attempt, run.tracker)
            run.evaluation.forget_after(start)
            steps.attempt = run_dir.next_attempt()
            echo(f"streamrl: {'the disk was full' if full else 'a process died'} ({err}); restarting the "
                 "trainer group and the DAG "
                 f"from step {start} (restart {run.restarts}/{cfg.train.max_restarts}, attempt {steps.attempt}; "
                 f"{len(dropped)} step(s) trained after that checkpoint are trained again)")
            run.tracker.set_tags({"restarts": run.restarts, "attempts": steps.attempt})
            progress.restart(start)


def run_attempt(run: Run, cfg: JobConfig, progress: Progress, stop=None) -> list[dict]:
    """One try with the attempt's config `cfg`: a fresh policy store, trainer group and DAG (and evaluator),
    from `run.checkpoint` (None: step 0). Returns where the trainer ranks ran."""
    checkpoint, run_dir, steps, tracker, lease = run.checkpoint, run.run_dir, run.steps, run.tracker, run.lease
    first, phases = run.start, run.phases
    store_name = f"streamrl-policy-{uuid.uuid4().hex[:8]}"
    store = create_policy_store(store_name, retain=tuple(run.evaluation.versions(first)))
    # The evaluator's actor and engine start after the first step (InTrainingEval.poll): they would compete
    # with the trainer ranks and the generators' engines for the cores while those start.
    evaluator = run.evaluation.start(store, first, progress.echo)
    workers = launch_trainer_group(cfg, run.model_path, store)
    ranks = RanksStarting(workers, phases)  # they initialise beside the engines; waited for at step 1
    critics, value_store, watch, placement = None, None, None, []
    stall = StallReport(cfg.train.stall_report_s, progress.echo, store)
    replicas = replica_placement(cfg)  # the generate actors' placement groups, released below
    try:
        if cfg.critic is not None:  # its own store; version -1 until rank 0 publishes the initialised critic
            value_store_name = f"streamrl-critic-{uuid.uuid4().hex[:8]}"
            value_store = create_policy_store(value_store_name, initial_version=-1)
            with phases.span("critic ranks"):
                critics, _ = start_critic_group(cfg, critic_model_path(cfg, run.model_path), value_store)
        if checkpoint is not None:  # rank 0 publishes the checkpoint's weights before any generator asks
            ray.get([worker.load_checkpoint.remote(str(checkpoint.path), checkpoint.step) for worker in workers]
                    + [critic.load_checkpoint.remote(str(checkpoint.path / CRITIC_DIR), checkpoint.step)
                       for critic in critics or []])
        frames = [frame for frame in run.schedule if int(frame["train_step"].iloc[0]) >= first]
        options = dict(
            checkpoints=StepCheckpoints(str(run_dir.root), every=cfg.train.checkpoint_every,
                                        keep=cfg.train.checkpoint_keep, hf_export=cfg.train.checkpoint_hf_export,
                                        run_info=run.run_info, attempt=steps.attempt,
                                        prior_rows=[row for row in checkpoint.step_rows()
                                                    if int(row["step"]) <= first] if checkpoint else None,
                                        prune_uploaded_only=cfg.tracking.enabled,
                                        fence=lease.fence if lease is not None else None),
            # each attempt its own folder: a step trained again must not replace a file still to be uploaded
            rollouts_dir=(str(Path(cfg.output_dir).resolve() / "rollouts" / run_dir.root.name / f"attempt_{steps.attempt}")
                          if cfg.tracking.enabled and cfg.tracking.log_rollouts else None),
            prior_ledger=str(checkpoint.path / LEDGER) if checkpoint else None,
            max_nan_skips=cfg.train.max_nan_skips, stop=stop,
        )
        with phases.span("DAG built"):
            configure_data_context(cfg, replicas)  # Ray Data's globals, before the DAG is made
            ds = build_dag(frames, stages(cfg, run.model_path, store, workers, stage_options(cfg), first_step=first,
                                          checkpoint_options=options, critics=critics, replicas=replicas))
        failure = None
        stall.start()  # from here on, a long wait for the next step says what it is waiting on
        try:
            for row in iter_steps(ds):
                stall.beat(int(row["step"]))
                if watch is None:  # the first step needed every rank: they are up
                    placement = ranks.result()
                    phases.from_first_step(row["timeline"])
                    say_placement(placement, tracker, progress.echo)
                    # A lost node that held a rank ends the attempt: the watch interrupts the main thread's
                    # wait on the DAG.
                    watch = NodeWatch(cfg, placement, progress.echo, on_lost=interrupt_main_thread).start()
                if lease is not None:
                    lease.check()  # another process took the run: stop before logging anything more
                row = {**row, "attempt": steps.attempt}
                steps.hold(row, int(row["step"]))
                progress.update(row)
                if row.get("checkpoint_path"):
                    steps.commit(int(row["step"]))
                    tracker.log_checkpoint(Path(row["checkpoint_path"]), int(row["step"]))
                    progress.echo(f"streamrl: checkpoint {row['checkpoint_path']} "
                                  f"({row.get('time_checkpoint', 0.0):.1f}s)")
                if row.get("nonfinite_skipped"):
                    progress.echo(f"streamrl: step {int(row['step'])}: the loss was not finite; step skipped, "
                                  "weights unchanged (train.nan_policy: skip)")
                run.rows.append({k: v for k, v in row.items() if k not in ("rollouts_parquet", "rollouts_path")})
                if evaluator is not None:
                    evaluator.poll(upto=int(row["step"]))
                if row.get("stopped"):  # a graceful stop: this step is trained and checkpointed
                    raise Preempted(f"stopped on SIGTERM after step {int(row['step'])}, which was "
                                    "trained and checkpointed", finished_step=True)
            if not placement:  # no step trained in this attempt (none was left)
                placement = ranks.result()
            if evaluator is not None:  # before the trainer group stops: rank 0 owns the retained weights
                with phases.span("waiting for evaluations"):
                    evaluator.finish()
            if watch is not None:
                watch.stop()  # inside the try: an interrupt it already sent lands here
        except KeyboardInterrupt:
            if watch is None or watch.lost is None:  # Ctrl-C, or the grace period of a stop running out
                raise
            failure = AttemptFailed(watch.lost, watch.lost, process_death=True)
        except Exception as err:  # keep its text, drop its frames (see AttemptFailed)
            err = ranks.failure(wait_s=2) or err  # a rank that failed to start: its own error, not the DAG's echo
            failure = AttemptFailed.from_exception(err)
            traceback.clear_frames(err.__traceback__)
    finally:
        stall.stop()
        if watch is not None:
            watch.stop()
        if evaluator is not None:
            evaluator.close()
        if replicas is not None:  # a restarted attempt makes new ones; these would hold their GPUs till exit
            replicas.release()
        stop_trainer_group(workers)
        try:
            run.loads.extend(store.load_log(timeout_s=10))
        except Exception:  # the store died with the attempt: its log is lost, the job is not
            pass
        store.kill()
        if critics is not None:
            stop_trainer_group(critics)
        if value_store is not None:
            value_store.kill()
    if failure is not None:
        del ds
        gc.collect()  # the failed DAG's actor handles sit in reference cycles: free them now
        raise failure
    return placement


class RanksStarting:
    """The trainer ranks initialising (DeepSpeed, the model) while the DAG starts its engines: a thread
    waits for them and keeps where they run, or the error of a rank that failed to start."""

    def __init__(self, workers, phases):
        self.placement: list[dict] = []
        self.error: BaseException | None = None
        begin = time.time()

        def wait() -> None:
            try:
                self.placement = workers.wait_ready()
            except BaseException as err:  # noqa: BLE001 - said by result() on the main thread
                self.error = err
                return
            # when the last rank was up (its `ready` call may run after a train step that came first)
            phases.add("trainer ranks", begin, max(rank["initialised_at"] for rank in self.placement))

        self.thread = threading.Thread(target=wait, name="streamrl-trainer-ranks", daemon=True)
        self.thread.start()

    def result(self) -> list[dict]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.placement

    def failure(self, wait_s: float) -> BaseException | None:
        """The error of a rank that failed to start, waiting at most `wait_s` for the ranks to be decided."""
        self.thread.join(timeout=wait_s)
        return self.error


def say_placement(placement: list[dict], tracker, echo) -> None:
    tracker.set_tags({f"trainer.rank{rank['rank']}.node_id": rank["node_id"] for rank in placement})
    if len(ray.nodes()) > 1:  # on a cluster: say where the ranks went (a restart may move them)
        echo(f"streamrl: trainer group placed: {placement_line(placement)}")


def say_backfilled(logged: list[int], echo) -> None:
    if logged:
        echo(f"streamrl: logged step(s) {', '.join(str(step + 1) for step in logged)} from the checkpoint "
             "(their rows had not reached MLflow before the process that trained them ended)")


def drop_uncommitted(steps: StepLog, run_dir: CheckpointDir, folder: Path, tracker, echo) -> None:
    """At the end of a job: what it trained after its last checkpoint stays out of the metric history (a
    resume trains it again), kept as an artifact instead. A finished job has nothing there."""
    dropped = steps.drop(resume_step(run_dir))
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


def resume_step(run_dir: CheckpointDir) -> int:
    """The step a resume of the run starts from: its last valid checkpoint's (0: none yet)."""
    checkpoint = run_dir.latest_valid(lambda _: None, hashes=False)
    return checkpoint.step if checkpoint else 0
