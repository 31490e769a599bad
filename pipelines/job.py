"""The RL job (every estimator: GRPO, RLOO, PPO with GAE, ...): one Ray Data streaming DAG, prompts -> generate -> reward -> advantage -> train.

    run_job(cfg)
      prepare   resolve the model, check and schedule the prompts, open the run (or reopen it, --resume):
                its checkpoint folder and lease, MLflow run, step log and evaluation plan
      attempts  in the Ray session: the stages (pipelines/stages.py) as one DAG (pipelines/dag.py),
                restarted from the last checkpoint after a process death (pipelines/recovery/attempts.py)
      report    overlap and weight-update metrics of the job, the final policy to MLflow
    -> one row of metrics + rollouts per step -> MLflow, terminal
    beside it (eval set): an evaluator actor scores held-out prompts with retained policy versions

The only loop is the weight channel (train -> policy store -> generate).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from operators.environments.sandbox import isolation
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.dag import schedule_groups
from pipelines.data.inputs import check_inputs
from pipelines.evaluation.in_training import load_eval_prompts
from pipelines.evaluation.plan import EvalPlan
from pipelines.recovery.attempts import Run, drop_uncommitted, resume_step, run_attempts, say_backfilled, take_lease
from pipelines.recovery.checkpoint import CheckpointDir, dataset_digest, next_run_sequence
from pipelines.recovery.preemption import Preempted, Preemption
from pipelines.recovery.resume import AttemptFailed, check_can_resume, describe_failure, resolve_run, run_file_info
from pipelines.recovery.step_log import EvalRows, StepLog
from pipelines.runtime.memory import local_object_store_mb
from pipelines.runtime.rollout_settings import sandbox_limits
from pipelines.runtime.session import check_object_store, ray_session
from pipelines.tracking.policy_model import log_final_policy
from pipelines.tracking.startup import Phases, wall_line
from pipelines.tracking.timeline import overlap_report
from pipelines.tracking.tracker import NullTracker, Tracker, announce_run


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
    started = time.time()
    run = prepare(cfg, echo, resume)
    run.phases = Phases(started)
    run.phases.add("prepare (model, prompts, run)", started, time.time())
    preemption = Preemption(cfg.train.on_preempt, cfg.train.preempt_grace_s, echo)
    status, run_id, tracker = "FAILED", run.run_id, run.tracker
    try:
        # After Ray's start: ray.init sets a SIGTERM handler of its own (sys.exit), which ours replaces.
        ray_start = time.time()
        with ray_session(cfg, local_object_store_mb(cfg, run.model_path)), preemption:
            run.phases.add("Ray", ray_start, time.time())
            check_object_store(cfg, run.model_path)  # the cluster's real object stores, before any actor starts
            run_attempts(run, preemption)
        final = report(run)
        echo(wall_line(time.time() - started, run.phases, run.overlap, run.evaluation.rows, len(run.rows)))
        status = "FINISHED"
    except Preempted as stopped:
        status = "KILLED"
        preemption.disarm()
        tracker.set_tags({"stopped_by": "preemption"})
        step = resume_step(run.run_dir)
        raise JobFailed(f"{stopped} (the last checkpoint is at step {step})", run_id, step, True, True) from None
    except KeyboardInterrupt:
        status = "KILLED"
        step = resume_step(run.run_dir)
        if preemption.grace_expired:  # a graceful stop that ran out of time: still a preemption
            tracker.set_tags({"stopped_by": "preemption"})
            raise JobFailed(f"stopped on SIGTERM before the step in progress ended (train.preempt_grace_s); "
                            f"the last checkpoint is at step {step}", run_id, step, True, True) from None
        raise JobFailed(f"interrupted at step {step}", run_id, step, True) from None
    except ConfigError:
        raise
    except Exception as err:
        step = resume_step(run.run_dir)
        summary = str(err) if isinstance(err, AttemptFailed) else describe_failure(err)
        raise JobFailed(f"{summary} (the last checkpoint is at step {step})", run_id, step) from err
    finally:
        preemption.disarm()
        drop_uncommitted(run.steps, run.run_dir, run.output_dir / "dropped" / run_id, tracker, echo)
        tracker.close(status, timeout_s=preemption.remaining_s() if preemption.requested_at is not None else None)
        # what the Train operator kept past checkpoint_keep while its upload was on the way, now delivered
        run.run_dir.prune(cfg.train.checkpoint_keep, require_uploaded=cfg.tracking.enabled)
        run.lease.release()
    echo(f"streamrl: done; checkpoint {final.path if final else None}; MLflow run {tracker.run_id}")
    return JobResult(tracker.run_id, pd.DataFrame(run.rows), final.path if final else None, run.model_path,
                     run.placement, run.output_dir, resume_id=run_id, eval_metrics=run.evaluation.table(),
                     weight_updates=pd.DataFrame(run.loads))


def prepare(cfg: JobConfig, echo: Callable[[str], None], resume: str | None) -> Run:
    """Everything before Ray: the model, the prompts and their schedule, the held-out set, and the run
    (new, or reopened from its last checkpoint). ConfigError for bad input, before anything starts."""
    # The models downloaded or converted once, then the check `streamrl validate` makes (pipelines/data/inputs.py):
    # every row, the template, the lengths, the reward functions' columns; ConfigError listing every problem.
    inputs = check_inputs(cfg, echo, resolve=True)
    model_path = inputs.model_path
    prompts, source = inputs.prompts(cfg.data, echo)
    schedule = schedule_groups(prompts, cfg)
    digest = dataset_digest(prompts)
    held_out = load_eval_prompts(cfg, model_path, echo) if cfg.eval is not None else None
    run_id, run_dir, lease, checkpoint, tracker = open_run(cfg, prompts, source, schedule, digest, echo, resume)
    start = checkpoint.step if checkpoint else 0
    echo(f"streamrl: {cfg.train.steps} steps x {cfg.train.groups_per_step} groups x {cfg.rollout.n} samples, "
         f"max_staleness={cfg.train.max_staleness}, model {model_path}")
    echo(announce_run(tracker))
    echo(isolation(sandbox_limits(cfg.sandbox).isolate_network)[1])  # what reward and tool code runs inside
    if resume is not None:
        where = f"checkpoint {checkpoint.path} (step {start})" if checkpoint else "the start (no checkpoint yet)"
        echo(f"streamrl: resuming run {run_id} from {where}")
        tracker.set_tags({"resume.from_step": start})
    run_info = {"run_id": run_id, "dataset": source, "dataset_digest": digest, "model_path": model_path}
    if held_out is not None:
        tracker.log_dataset(held_out[0], held_out[1], "eval")
    output_dir = Path(cfg.output_dir).resolve()
    # Step rows and evaluations reach MLflow once a checkpoint covers them (pipelines/recovery/step_log.py).
    steps = StepLog(tracker, committed=start, attempt=run_dir.next_attempt(),
                    retrained_dir=output_dir / "retrained" / run_id, echo=echo)
    tracker.set_tags({"attempts": steps.attempt})
    if resume is not None:  # steps the dead driver had not logged when its checkpoint was written
        say_backfilled(steps.backfill(checkpoint, steps.attempt - 1, tracker.train_steps_logged()), echo)
    evaluation = EvalPlan(cfg, held_out[0] if held_out else None, model_path, tracker, output_dir / "eval" / run_id,
                          log=EvalRows(steps))
    return Run(cfg, model_path, schedule, tracker, run_id, run_dir, run_info, lease, steps, evaluation, echo,
               checkpoint=checkpoint)


def open_run(cfg: JobConfig, prompts: pd.DataFrame, source: str, schedule: list[pd.DataFrame], digest: str,
             echo: Callable[[str], None], resume: str | None):
    """A new run (its folder, run file and lease; the MLflow run if tracked), or the run `resume` names,
    checked against this config and reopened at its last valid checkpoint. Returns (run_id, run_dir,
    lease, checkpoint, tracker)."""
    output_dir = Path(cfg.output_dir).resolve()
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
    return run_id, run_dir, lease, checkpoint, tracker


def report(run: Run):
    """After the last step: the job's overlap and weight-update metrics (MLflow and terminal), the final
    policy logged as an MLflow model if asked. Returns the final checkpoint."""
    cfg, echo, rows, loads = run.cfg, run.echo, run.rows, run.loads
    echo(run.phases.line())
    if rows:
        overlap = run.overlap = overlap_report([row["timeline"] for row in rows])
        run.tracker.log_step({"step": cfg.train.steps, **{f"job_{k}": v for k, v in overlap.items()},
                              **weight_update_summary(loads)})
        echo(f"streamrl: overlap efficiency {overlap['overlap_efficiency']:.2f} "
             f"(trainer idle {overlap['trainer_idle_fraction']:.0%}, "
             f"generators idle {overlap['generator_idle_fraction']:.0%} over {overlap['window_s']:.0f}s)")
        if loads:
            summary = weight_update_summary(loads)
            echo(f"streamrl: {len(loads)} weight updates in flight: pause {summary['job_weight_pause_s_median'] * 1e3:.0f} ms "
                 f"median ({summary['job_weight_pause_s_max'] * 1e3:.0f} ms max); pull + prepare "
                 f"{summary['job_weight_pull_prepare_s_median'] * 1e3:.0f} ms median while decoding went on; "
                 f"{summary['job_weight_updates_verified']} verified by checksums, "
                 f"{summary['job_weight_updates_probed']} by the served-policy probe"
                 + (f" (largest gap {summary['job_probe_gap_max']:.1e} per token)" if 'job_probe_gap_max' in summary else ""))
    final = run.run_dir.latest_valid(echo, hashes=False)
    if cfg.tracking.log_model:
        log_final_policy(run.tracker, final, cfg, echo)
    return final


def weight_update_summary(loads: list[dict]) -> dict[str, float]:
    """Job metrics of the in-flight engines' weight updates (none for call-synchronous engines)."""
    if not loads:
        return {}
    import numpy as np

    pause = np.array([load["pause_s"] for load in loads])
    overlapped = np.array([load["pull_s"] + load["prepare_s"] for load in loads])
    gaps = [float(load["probe_gap"]) for load in loads if load.get("probe_gap") is not None]
    return {"job_weight_updates": len(loads), "job_weight_pause_s_median": float(np.median(pause)),
            "job_weight_pause_s_max": float(pause.max()), "job_weight_pause_s_total": float(pause.sum()),
            "job_weight_pull_prepare_s_median": float(np.median(overlapped)),
            # the weight plane: updates whose checksums the engine compared with the trainer's (all matched:
            # a mismatch ends the attempt), and the tensors compared
            "job_weight_updates_verified": int(sum(bool(load.get("verified")) for load in loads)),
            "job_weight_tensors_checked": int(sum(int(load.get("checked", 0)) for load in loads)),
            # the served-policy probe (operators/weights/probe.py): updates whose engine scored it (all within the
            # tolerance: a gap beyond ends the attempt), and the largest mean gap per token
            "job_weight_updates_probed": len(gaps), **({"job_probe_gap_max": max(gaps)} if gaps else {})}

