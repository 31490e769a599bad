"""Train operator: the last stage of the RL DAG, in front of a DeepSpeed worker group.

Rows (prompt groups) arrive in any block size; each carries the `train_step` it was
scheduled for. The operator buffers rows by step (a `map_batches` batch is never exactly
one step) and, when step s is complete and s-1 is done, explodes the groups into
samples, shards them evenly over the ranks, runs one optimizer step, and yields one row
of step metrics with that step's rollouts (lineage columns included): Parquet bytes in the row, or,
given a `rollouts_dir`, a file written atomically before the row leaves and its path.
Rank 0 publishes version s+1 to the policy store; that is what lets generation of later
steps through the admission gate.

Exactly once: a group is keyed by its `group_uid`; one that arrives again (a generate task
retried after its actor died, or a group already in the resumed checkpoint's ledger) is
dropped and counted (`duplicate_groups`). Every `checkpoint_every` steps and after the last
one, the operator writes a resumable checkpoint (pipelines/recovery/checkpoint.py) between two
optimizer steps: the ranks' DeepSpeed state, RNG states and the ledger of every group
trained so far, which is the data cursor a resumed job continues from.

With a critic group (PPO with GAE), the same step also trains the critic ranks on the
step's return targets, beside the policy ranks; their state goes into the checkpoint's
`critic/` folder.

The pure parts live beside it: how the step's batch is made and cut in operators/algorithms/step_batch.py,
the metric families in operators/stages/train_metrics.py, the rollouts table in operators/stages/tables.py; the ranks in
operators/workers/.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from operators.algorithms.step_batch import (
    explode,
    select_informative,
    shard,
    split_critic_samples,
    step_normalisers,
    subset,
    token_masks,
)
from operators.common.durable import write_atomic
from operators.stages.reward import FailedRewardSteps
from operators.stages.tables import StepRollouts, rollouts_table
from operators.stages.train_metrics import (
    critic_metrics,
    dynamic_sampling_metrics,
    rank_metrics,
    reward_metrics,
    step_timeline,
    timing_metrics,
)
from operators.workers.engine_steps import NonFiniteError

# The ledger: one row per group a step consumed, the record exactly-once resume and `streamrl lineage`
# read (checkpoints carry it: pipelines/recovery/checkpoint.py). `used`: the group was in its step's update (dynamic
# sampling leaves some out, `dropped` says why: zero_variance or surplus); `trained`: the step's update was
# applied (not skipped for a non-finite loss). `policy_version` / `policy_version_max`: the oldest / newest
# version that sampled a token of the group. `generator_id`: the generate actor that sampled it (host:pid), so
# a fault or an autoscaled pool can be traced to the actor.
LEDGER_COLUMNS = ["train_step", "group_uid", "prompt_id", "epoch", "policy_version", "policy_version_max", "staleness",
                  "trained", "used", "dropped", "generator_id"]


def _ledger_rows(table: pd.DataFrame, trained: bool) -> pd.DataFrame:
    """The ledger's record of one step: which groups (prompt ids, policy versions) it consumed."""
    rows = table.assign(trained=trained)
    rows["epoch"] = rows["epoch"].astype("Int64")
    return rows.reindex(columns=LEDGER_COLUMNS).reset_index(drop=True)


class Train:
    def __init__(
        self,
        workers: Sequence,
        groups_per_step: int,
        total_steps: int,
        first_step: int = 0,
        success_threshold: float = 1.0,
        checkpoints=None,
        stop=None,
        prior_ledger: str | None = None,
        max_nan_skips: int | None = None,
        whiten_advantages: str | None = None,
        generated_per_step: int | None = None,
        dynamic_sampling: bool = False,
        critics: Sequence = (),
        mini_batches: int = 1,
        rollouts_dir: str | None = None,
        reward_failed_steps: int = 1,
    ):
        """`total_steps` counts from `first_step` (a resumed job's first step). `checkpoints`: what writes
        resumable checkpoints between steps, or None for none; any object with `due(steps_done, last)` and
        `write(steps_done, workers, critics, ledger, last) -> Path` (a job passes pipelines.recovery.checkpoint.StepCheckpoints;
        this operator imports nothing of pipelines/). `stop`: asked after each step, `stop.requested()`
        True means a graceful stop: that step is checkpointed and its row says `stopped`
        (pipelines.recovery.preemption.StopRequest). `prior_ledger`: the ledger (LEDGER_COLUMNS, parquet) of
        the checkpoint the job resumed from. `whiten_advantages`: whiten each step's advantages over the whole step
        (operators.algorithms.estimators.whiten_over_step; REINFORCE++, GAE) before training on them: "token" over
        every trained token (a response's advantage counts once per token, observation tokens not at all),
        "response" once per response; None: not. `generated_per_step`:
        groups scheduled per step (default groups_per_step); with `dynamic_sampling` the step trains
        `groups_per_step` of them (`select_informative`), and the ledger records the others as dropped.
        `critics`: the critic group's ranks (operators.workers.value_worker.ValueWorker), trained each step on the
        rows' `returns` and `values` (from the Value and Advantage stages). `mini_batches`: the trainer's
        (train.mini_batches); above 1 the ranks get equal sample counts, else equal token counts.
        `rollouts_dir`: write each step's rollouts there (`step_NNNNNN.parquet`, atomically, before the step's
        checkpoint and row) and put its path in the row (`rollouts_path`) and in the checkpoint's rows, so
        they outlive a driver that dies before it hears of the step; None: the row carries the Parquet
        bytes (`rollouts_parquet`). `reward_failed_steps`: steps in a row a reward function may raise on every
        sample of before the job stops, naming it (operators.stages.reward.FailedRewardSteps)."""
        self.rollouts_dir = Path(rollouts_dir) if rollouts_dir else None
        if self.rollouts_dir is not None:
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        self.mini_batches = mini_batches
        self.generated_per_step = generated_per_step or groups_per_step
        self.dynamic_sampling = dynamic_sampling
        if whiten_advantages not in (None, "token", "response"):
            raise ValueError(f"whiten_advantages: {whiten_advantages!r}; use 'token', 'response' or None")
        self.whiten_advantages = whiten_advantages
        self.workers = list(workers)
        self.critics = list(critics)
        self.groups_per_step = groups_per_step
        self.end_step = first_step + total_steps
        self.next_step = first_step
        self.success_threshold = success_threshold
        self.checkpoints = checkpoints
        self.unsaved_rows: list[dict] = []  # metric rows of the steps since the last checkpoint
        self.stop, self.stopped = stop, False
        self.ledger: list[pd.DataFrame] = [pd.read_parquet(prior_ledger)] if prior_ledger else []
        self.seen: set[str] = set(self.ledger[0]["group_uid"]) if self.ledger else set()
        self.duplicates = 0
        # Steps skipped for a non-finite loss (train.nan_policy: skip), the resumed ledger's included.
        self.max_nan_skips = max_nan_skips
        self.nan_skips = int(self.ledger[0].loc[~self.ledger[0]["trained"], "train_step"].nunique()) if self.ledger else 0
        self.reward_failures = FailedRewardSteps(reward_failed_steps)
        self.buffer: dict[int, list[dict]] = defaultdict(list)
        self.last_step_end = time.perf_counter()
        self.idle_seconds = 0.0
        self.busy_seconds = 0.0
        # Calls may run side by side (the RL DAG runs this in a threaded actor, so the next step's groups
        # are taken in while a step trains and it can start the moment that one ends). `_state` guards the
        # buffer and its bookkeeping; `_training` lets one call at a time train, steps in order.
        self._state = threading.Lock()
        self._training = threading.Lock()

    def __call__(self, batch: pd.DataFrame) -> Iterator[pd.DataFrame]:
        self._take_in(batch)
        while self._pop_ready(peek=True):
            if not self._training.acquire(blocking=False):
                return  # the call training now looks again after it lets go, and trains this step then
            try:
                while (ready := self._pop_ready()) is not None:
                    yield self._run_step(*ready)  # the lock is held across the yield: rows leave in step order
            finally:
                self._training.release()

    def _take_in(self, batch: pd.DataFrame) -> None:
        """Buffer the batch's rows by step, dropping (and counting) the groups seen before."""
        arrived = time.time()
        with self._state:
            for row in batch.to_dict("records"):
                row["train_arrive"] = arrived
                step = int(row["train_step"])
                uid = row.get("group_uid")
                if uid is not None and uid in self.seen:  # a retried task's output, or already in the ledger
                    self.duplicates += 1
                    continue
                if not self.next_step <= step < self.end_step:
                    raise ValueError(f"row {uid} is for step {step}, outside [{self.next_step}, {self.end_step})")
                if uid is not None:
                    self.seen.add(uid)
                self.buffer[step].append(row)

    def _pop_ready(self, peek: bool = False):
        """The next step's number and rows (schedule order) if all its groups are in, else None; with
        `peek`, only whether they are. None for good after a graceful stop: nothing past its checkpoint
        is trained (the job is tearing the DAG down meanwhile)."""
        with self._state:
            if self.stopped or len(self.buffer.get(self.next_step, ())) < self.generated_per_step:
                return None
            if peek:
                return True
            # In schedule order, not arrival order: the step's sums (loss, gradient) then add up in the
            # same order however the stream interleaved the calls, so a resumed run repeats the same floats.
            step = self.next_step
            rows = sorted(self.buffer.pop(step), key=lambda row: str(row.get("group_uid")))
            self.next_step += 1
            return step, rows

    def _run_step(self, step: int, rows: list[dict]) -> pd.DataFrame:
        """One train step on its rows (schedule order): the step's groups chosen and whitened, the ranks'
        optimizer step, its metrics, ledger, rollouts and checkpoint; one metrics row out."""
        wall_start = time.time()
        start = time.perf_counter()
        waited = start - self.last_step_end  # trainer idle: waiting for this step's data
        generated = [{**row, "staleness": step - int(row["policy_version"])} for row in rows]
        self.reward_failures.check(step, generated)  # a step scored only by on_error is not trained
        rows, dropped = self._select(generated)
        rows = self._whiten(rows)
        # Every generated group (what the policy did), with the advantages it trained on where `used`, as numpy
        # columns once: the ranks train on the used groups' samples, the rollouts Parquet is written from all.
        trained_rows = {row["group_uid"]: row for row in rows}
        step_rows = [trained_rows.get(row["group_uid"], row) for row in generated]
        samples = explode(step_rows)
        results, critic_results = self._train(self._used(samples, step_rows, trained_rows))
        end = self._account_time(start, waited)
        step_rollouts = rollouts_table(step_rows, step, dropped, samples)
        table = step_rollouts.groups
        metrics = self._metrics(step, table, rows, dropped, results, critic_results, waited, start, end)
        self._record_in_ledger(table, trained=not metrics.get("nonfinite_skipped"))
        rollouts = self._write_rollouts(step_rollouts, step)
        self._keep_for_checkpoint(metrics, rollouts)
        checkpoint_start = time.perf_counter()
        checkpoint = self._checkpoint_or_stop(step, metrics)
        metrics["time_checkpoint"] = time.perf_counter() - checkpoint_start  # trainer blocked while it writes
        timeline = step_timeline(wall_start, end - start, rows, generated)
        return pd.DataFrame([{
            **metrics, "timeline": timeline, **rollouts,
            "checkpoint_path": str(checkpoint) if checkpoint else None,
        }])

    def _select(self, rows: list[dict]) -> tuple[list[dict], dict[str, str]]:
        """The groups the step trains, and per group_uid left out why: all of them, or with dynamic
        sampling `groups_per_step` informative ones first (operators.algorithms.step_batch.select_informative)."""
        if not self.dynamic_sampling:
            return rows, {}
        return select_informative(rows, self.groups_per_step)

    def _whiten(self, rows: list[dict]) -> list[dict]:
        """The rows with their advantages whitened over every group of the step (so the ranks' shards share
        one mean and std), when asked for."""
        if not self.whiten_advantages:
            return rows
        from operators.algorithms.estimators import whiten_over_step

        masks = [token_masks(row) for row in rows] if self.whiten_advantages == "token" else None
        whitened = whiten_over_step([row["advantages"] for row in rows], masks)
        return [{**row, "advantages": advantages} for row, advantages in zip(rows, whitened)]

    @staticmethod
    def _used(samples: dict, step_rows: list[dict], trained_rows: dict) -> dict:
        """The samples of the groups the update trains (explode's order: group after group)."""
        used = np.array([row["group_uid"] in trained_rows for row in step_rows], dtype=bool)
        if used.all():
            return samples
        sizes = [len(row["response_token_ids"]) for row in step_rows]
        return subset(samples, np.flatnonzero(np.repeat(used, sizes)))

    def _train(self, samples: dict) -> tuple[list[dict], list[dict]]:
        """The step's samples (explode's columns) sharded over the policy ranks (and the critic ranks), one
        train step each; the ranks' results (policy, critic)."""
        import ray

        samples = dict(samples)  # split_critic_samples takes the critic's columns out
        critic_samples = split_critic_samples(samples)
        shards = shard(samples, len(self.workers), equal_counts=self.mini_batches > 1)
        global_tokens, global_sequences = step_normalisers(samples)
        calls = [
            worker.train_step.remote(part, global_tokens, global_sequences)
            for worker, part in zip(self.workers, shards)
        ]
        critic_calls = self._critic_calls(samples, critic_samples, global_tokens, global_sequences)
        return ray.get(calls), ray.get(critic_calls)

    def _account_time(self, start: float, waited: float) -> float:
        """Add the step to the trainer's idle and busy time; the step's end."""
        end = time.perf_counter()
        if self.busy_seconds:  # the wait before the first step is start-up, not idleness
            self.idle_seconds += waited
        self.busy_seconds += end - start
        self.last_step_end = end
        return end

    def _metrics(self, step: int, table: pd.DataFrame, rows: list[dict], dropped: dict[str, str], results: list[dict],
                 critic_results: list[dict], waited: float, start: float, end: float) -> dict:
        """The step's metrics row (operators/stages/train_metrics.py's families, and the trainer's own figures)."""
        return {
            # The step as users read it everywhere (terminal, MLflow, checkpoints, lineage, group ids): 1 for
            # the first; it is the policy version the step produced. `train_step` in the rows, the ledger and
            # the schedule is the step's 0-based index: the version it trained from.
            "step": step + 1,
            **reward_metrics(table, self.success_threshold),
            **rank_metrics(results),
            **timing_metrics(rows, waited, start, end),
            "trainer_idle_fraction": waited / max(waited + end - start, 1e-9),
            "trainer_idle_fraction_cum": self.idle_seconds / max(self.idle_seconds + self.busy_seconds, 1e-9),
            "policy_version": step + 1,  # one version per train step, however many optimizer steps it took
            "duplicate_groups": self.duplicates,
            "overlong_shaped": int(sum(row.get("overlong_shaped", 0) for row in rows)),
            **(dynamic_sampling_metrics(rows, dropped) if self.dynamic_sampling else {}),
            **(critic_metrics(critic_results, rows) if critic_results else {}),
        }

    def _record_in_ledger(self, table: pd.DataFrame, trained: bool) -> None:
        """Add the step's groups to the ledger; a step skipped for a non-finite loss counts against
        max_nan_skips, and one too many stops the job."""
        self.ledger.append(_ledger_rows(table, trained=trained))
        if not trained:
            self.nan_skips += 1
            if self.max_nan_skips is not None and self.nan_skips > self.max_nan_skips:
                raise NonFiniteError(
                    f"{self.nan_skips} steps had a non-finite loss (train.max_nan_skips: {self.max_nan_skips}); "
                    "stopping. Lower train.lr, check the rewards, or raise train.max_nan_skips"
                )

    def _write_rollouts(self, step_rollouts: StepRollouts, step: int) -> dict:
        """The step's rollouts for its row: Parquet bytes, or with a rollouts_dir the path of the file
        written there (atomically, before the step's checkpoint and row)."""
        rollouts = {"rollouts_parquet": step_rollouts.to_parquet()}
        if self.rollouts_dir is not None:
            path = self.rollouts_dir / f"step_{step + 1:06d}.parquet"  # the step as users count it
            write_atomic(path, rollouts.pop("rollouts_parquet"), what=f"the rollouts of step {step + 1}")
            rollouts["rollouts_path"] = str(path)
        return rollouts

    def _keep_for_checkpoint(self, metrics: dict, rollouts: dict) -> None:
        """What the checkpoint keeps of this step's row, for a driver that dies before logging it."""
        self.unsaved_rows.append({**{key: value.item() if isinstance(value, np.generic) else value
                                     for key, value in metrics.items()
                                     if isinstance(value, (int, float, bool, np.integer, np.floating))},
                                  **{key: value for key, value in rollouts.items() if key == "rollouts_path"}})

    def _checkpoint_or_stop(self, step: int, metrics: dict) -> Path | None:
        """A checkpoint after the step if one is due, or if a graceful stop was asked for (then this step is
        the last one trained: `stopped` in its row); the checkpoint's path, or None."""
        stopping = self.stop is not None and step + 1 < self.end_step and self.stop.requested()
        checkpoint = self._maybe_checkpoint(step + 1, force=stopping)
        self.stopped = stopping
        metrics["stopped"] = bool(stopping)  # a graceful stop was asked for: this step is the last one trained
        return checkpoint

    def _critic_calls(self, samples: dict, critic_samples: dict, global_tokens: int, global_sequences: int) -> list:
        if not self.critics:
            return []
        if "returns" not in critic_samples:
            raise ValueError("a critic needs rows with `returns` and `values`: put the Value stage before a token "
                             "estimator (algorithm.advantage: gae)")
        return [critic.train_step.remote(part, global_tokens, global_sequences)
                for critic, part in zip(self.critics, shard(critic_samples, len(self.critics),
                                                            equal_counts=self.mini_batches > 1))]

    def _maybe_checkpoint(self, steps_done: int, force: bool = False) -> Path | None:
        """After `steps_done` optimizer steps: write a checkpoint if one is due (policy version = steps_done),
        or if `force` (a graceful stop)."""
        last = steps_done == self.end_step
        if self.checkpoints is None or not (force or self.checkpoints.due(steps_done, last)):
            return None
        ledger = pd.concat(self.ledger, ignore_index=True)
        path = self.checkpoints.write(steps_done, self.workers, self.critics, ledger, last,
                                      step_rows=self.unsaved_rows)
        self.unsaved_rows = []
        return path
