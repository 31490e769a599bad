"""Resuming a run: find it, check that this config and dataset can continue it, and classify
failures that a restart from the last checkpoint can fix.

`streamrl run CONFIG --resume RUN_ID|latest` continues the run's MLflow run at the step
after its newest valid checkpoint. The config may change only where the change cannot
alter what is learned (resources, tracking, checkpoint cadence, a longer `train.steps`);
the prompts must be the same (digest) and schedule the same groups; anything else is
refused with the differing fields, before any actor starts.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pandas as pd

from pipelines.recovery.checkpoint import Checkpoint, CheckpointDir, CheckpointError, checked_run_id, find_run_dirs
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.config.load import flatten

# Fields a resumed run may change: where and how it runs, not what it learns.
MAY_CHANGE = (
    "tracking.", "sandbox.", "ray.", "output_dir", "train.steps", "train.checkpoint_every", "train.checkpoint_keep",
    "train.max_restarts", "train.node_wait_s", "train.disk_full_wait_s", "train.checkpoint_hf_export", "train.nan_policy", "train.max_nan_skips", "train.placement", "train.num_cpus",
    "train.num_gpus", "train.resources", "train.torch_threads", "rollout.num_actors", "rollout.replace_wait_s", "rollout.num_cpus",
    "rollout.num_gpus", "rollout.resources", "rollout.torch_threads", "reward.num_actors", "reward.num_cpus",
    "reward.placement", "reward.timeout_s", "data.invalid_prompts", "train.zero3_persistence_threshold",
    "train.on_preempt", "train.preempt_grace_s", "train.weight_bucket_mb", "rollout.vllm.tensor_parallel_size",
    "eval",  # held-out evaluation reads the policy, never changes it
    "reference.num_actors", "reference.num_cpus", "reference.num_gpus", "reference.resources",
    "reference.torch_threads", "reference.micro_batch_tokens",
    "critic.num_cpus", "critic.num_gpus", "critic.resources", "critic.placement", "critic.placement_timeout_s",
    "critic.torch_threads", "critic.value_num_cpus",
)

# Ray errors that mean a process died (not that the code is wrong): a restart can fix them.
_PROCESS_DEATHS = (
    "ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError",
    "OwnerDiedError", "ObjectLostError", "ObjectReconstructionFailedError", "ActorPlacementGroupRemoved",
    # the weight plane (operators/weights/gloo_plane.py): an engine died mid-transfer, or stopped receiving
    "WeightTransferError",
)
# What a surviving trainer rank's collective raises when a peer rank's process is gone (torch.distributed's
# gloo transport, pair.cc: a read that finds the socket closed, or reset, a write that finds it gone); with
# a node lost it can arrive before Ray reports the dead rank. "Connection reset by peer" came up in the chaos
# run (benchmarks/chaos.py: a node killed mid-step) and failed the job instead of restarting it.
_PEER_DEATHS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def resolve_run(output_dir: Path, resume: str, field: str = "--resume") -> str:
    """The run id `--resume` (or `field`) names: itself, or the newest run under `output_dir` for 'latest'."""
    if resume != "latest":
        try:
            checked_run_id(resume, field)
        except CheckpointError as err:
            raise ConfigError([(field, str(err).removeprefix(f"{field}: "))]) from None
    runs = find_run_dirs(output_dir)
    if resume == "latest":
        if not runs:
            raise ConfigError([(field, f"no run under {Path(output_dir) / 'checkpoints'}; pass the output_dir "
                                       "the run used" + (" (or start one without --resume)" if field == "--resume" else ""))])
        return runs[-1].name
    if not (Path(output_dir) / "checkpoints" / resume).is_dir():
        known = ", ".join(p.name for p in runs[-5:]) or "none"
        raise ConfigError([(field, f"run {resume!r} has no folder under {Path(output_dir) / 'checkpoints'} "
                                   f"(runs there: {known}); check the id and output_dir, or use 'latest'")])
    return resume


def config_changes(saved: dict, cfg: JobConfig) -> list[tuple[str, str]]:
    """(field, message) for every field that differs from the run's and may not change."""
    now = flatten(cfg)
    before = {key: value for key, value in saved.items()}
    defaults = flatten(JobConfig())
    problems = []
    for key in sorted(set(now) | set(before)):
        if key.startswith(MAY_CHANGE) or now.get(key) == before.get(key):
            continue
        if key not in before and key in defaults and now.get(key) == defaults[key]:
            continue  # a field added since the run was saved, at its default: what the run did before it existed
        problems.append((key, f"the run used {before.get(key)!r}, this config has {now.get(key)!r}; a resumed run "
                              "must learn the same way: use the run's value, or start a new run without --resume"))
    return problems


def check_can_resume(
    cfg: JobConfig, run_dir: CheckpointDir, checkpoint: Checkpoint | None, schedule: list[pd.DataFrame], digest: str
) -> None:
    """Raise ConfigError unless this config and these prompts continue the run exactly."""
    try:
        info = run_dir.run_file()
    except CheckpointError as err:
        raise ConfigError([("--resume", str(err))]) from None
    if info is None:
        raise ConfigError([("--resume", f"{run_dir.root} has no run.json; it is not a streamrl run folder")])
    problems = config_changes(info["config"], cfg)
    if info.get("dataset_digest") != digest:
        problems.append(("data.path", f"the prompts differ from the run's (digest {info.get('dataset_digest')} "
                                      f"then, {digest} now); resume with the same dataset"))
    if checkpoint is not None:
        if checkpoint.step > cfg.train.steps:
            problems.append(("train.steps", f"{cfg.train.steps} is below the checkpoint's step {checkpoint.step}"))
        elif checkpoint.step == cfg.train.steps:
            problems.append(("--resume", f"run {run_dir.root.name} is finished: its last checkpoint is at step "
                                         f"{checkpoint.step} = train.steps, so there is nothing to resume; raise "
                                         "train.steps to train it further, or start a new run without --resume"))
        expected = pd.concat(schedule, ignore_index=True)
        expected = expected[expected["train_step"] < checkpoint.step].set_index("group_uid")["prompt_id"]
        ledger = checkpoint.ledger().set_index("group_uid")["prompt_id"]
        if len(ledger) != len(expected) or not ledger.sort_index().astype(str).equals(expected.sort_index().astype(str)):
            problems.append(("data", f"the checkpoint's ledger ({len(ledger)} groups) does not match the groups "
                                     f"this config schedules before step {checkpoint.step} ({len(expected)}); the data "
                                     "order changed (data.seed, data.shuffle, train.groups_per_step?)"))
    if problems:
        raise ConfigError(problems, f"resume {run_dir.root.name}")


def run_file_info(cfg: JobConfig, run_id: str, digest: str, started_at: float, sequence: int | None = None) -> dict:
    """A new run's run.json. `sequence`: its number among the runs of its output_dir (next_run_sequence),
    what `--resume latest` orders runs by."""
    info = {"run_id": run_id, "config": flatten(cfg), "dataset_digest": digest, "started_at": started_at}
    return info if sequence is None else {**info, "sequence": sequence}


class AttemptFailed(RuntimeError):
    """One try of a job failed. Carries the failure as text only: the original exception's
    traceback holds the Ray Data executor and its actor handles, and while any handle lives
    its actor (and the CPUs it reserved) stays up, starving the next try of resources."""

    def __init__(self, summary: str, details: str, process_death: bool):
        super().__init__(summary)
        self.details, self.process_death = details, process_death

    @classmethod
    def from_exception(cls, err: BaseException) -> "AttemptFailed":
        return cls(describe_failure(err), "".join(traceback.format_exception(err)), is_process_death(err))


def is_disk_full_failure(err: BaseException) -> bool:
    """True when an attempt ended on a full disk (operators.common.durable.DiskFullError, raised in the Train actor:
    Ray Data passes it on as text), which waiting for room and restarting can get past."""
    text = err.details if isinstance(err, AttemptFailed) else "".join(traceback.format_exception(err))
    return "DiskFullError" in text


def describe_failure(err: BaseException) -> str:
    """One line: which process died (class and pid, when Ray says), else the error itself."""
    text = "".join(traceback.format_exception(err))
    for name in _PROCESS_DEATHS:
        match = re.search(rf"{name}: (.*)", text)
        if match:
            who = re.search(r"class_name: (\w+)", text[match.start():])
            pid = re.search(r"pid: (\d+)", text[match.start():])
            actor = f" ({who.group(1)}{f', pid {pid.group(1)}' if pid else ''})" if who else ""
            return f"{name}{actor}: {match.group(1).strip()}"[:300]
    for line in reversed(text.strip().splitlines()):  # the innermost error is last
        if re.match(r"^[\w.]+(Error|Exception)\b", line):
            return line.strip()[:300]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def is_process_death(err: BaseException) -> bool:
    """True when `err` comes from a Ray process dying (restartable), not from a bug or bad numbers."""
    if isinstance(err, AttemptFailed):
        return err.process_death
    text = "".join(traceback.format_exception(err))
    if "NonFiniteError" in text:  # numbers, not processes: a restart would only repeat it
        return False
    chain, seen = [err], set()
    while chain:
        current = chain.pop()
        if id(current) in seen or current is None:
            continue
        seen.add(id(current))
        if type(current).__name__ in _PROCESS_DEATHS:
            return True
        chain += [getattr(current, "cause", None), current.__cause__, current.__context__]
    # Ray Data re-raises a failed operator task as its own exception type with the original
    # traceback as text; the dead actor's error class is only visible there.
    return any(name in text for name in _PROCESS_DEATHS) or ("gloo" in text and any(name in text for name in _PEER_DEATHS))


def resume_command(config: str, overrides: list[str], run_id: str) -> str:
    import shlex

    sets = [part for item in overrides for part in ("--set", item)]
    return shlex.join(["streamrl", "run", config, *sets, "--resume", run_id])
