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
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pandas as pd

from operators.algorithms.batching import trained_tokens
from operators.durable import write_atomic

# `policy_version` is the oldest version that sampled a token of the group (what staleness counts),
# `policy_version_max` the newest: they differ only under partial rollout, where `token_policy_versions`
# gives the version of every response token; `generator_id` the generate actor (host:pid) that sampled it.
# `prompt_text` is the prompt as the model read it (chat template applied); `response_token_ids` the sampled
# tokens, the stop token included.
ROLLOUT_COLUMNS = [
    "prompt_id", "group_uid", "epoch", "policy_version", "policy_version_max", "train_step", "staleness", "prompt",
    "prompt_text", "responses", "response_token_ids", "response_lengths", "token_policy_versions", "rewards", "advantages", "reward_errors",
    "reward_timeouts", "used", "dropped", "generator_id",
]
STAGES = ("generate", "weight_sync", "reward", "advantage")
# Wall-clock stamps a group collects on its way to a train step (Generate's, Reward's with timestamps=True, and
# when this operator received it), kept per step in the `timeline` for benchmarks/loop_latency.py.
STAMPS = ("generate_start", "generate_end", "reward_start", "reward_end", "train_arrive")
# Multi-turn episodes (operators/environment.py): each episode's turns (JSON: text, tool_call, observation,
# reward, error, ended_by, tokens, version), turn count, what ended it, the environment's reward, and per
# response token 1 (the policy's) or 0 (an observation's).
EPISODE_COLUMNS = ["loss_masks", "turns", "num_turns", "episode_ends", "env_rewards", "tool_calls", "tool_errors", "env_errors"]
# With a critic: the version that valued the group, and per response token its values and return targets.
CRITIC_COLUMNS = ["critic_version", "values", "returns"]


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
        bytes (`rollouts_parquet`)."""
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
        while self._pop_ready(peek=True):
            if not self._training.acquire(blocking=False):
                return  # the call training now looks again after it lets go, and trains this step then
            try:
                while (ready := self._pop_ready()) is not None:
                    yield self._run_step(*ready)  # the lock is held across the yield: rows leave in step order
            finally:
                self._training.release()

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
        import ray

        wall_start = time.time()
        start = time.perf_counter()
        waited = start - self.last_step_end  # trainer idle: waiting for this step's data
        rows = [{**row, "staleness": step - int(row["policy_version"])} for row in rows]
        generated = rows
        dropped: dict[str, str] = {}
        if self.dynamic_sampling:
            rows, dropped = select_informative(rows, self.groups_per_step)
        if self.whiten_advantages:  # over every group of the step, so the ranks' shards share one mean and std
            from operators.algorithms.estimators import whiten_over_step

            masks = [_token_masks(row) for row in rows] if self.whiten_advantages == "token" else None
            whitened = whiten_over_step([row["advantages"] for row in rows], masks)
            rows = [{**row, "advantages": advantages} for row, advantages in zip(rows, whitened)]
        samples = _explode(rows)
        critic_samples = split_critic_samples(samples)
        shards = _shard(samples, len(self.workers), equal_counts=self.mini_batches > 1)
        global_tokens, global_sequences = step_normalisers(samples)
        calls = [
            worker.train_step.remote(shard, global_tokens, global_sequences)
            for worker, shard in zip(self.workers, shards)
        ]
        critic_calls = self._critic_calls(samples, critic_samples, global_tokens, global_sequences)
        results = ray.get(calls)
        critic_results = ray.get(critic_calls)
        end = time.perf_counter()
        if self.busy_seconds:  # the wait before the first step is start-up, not idleness
            self.idle_seconds += waited
        self.busy_seconds += end - start
        self.last_step_end = end
        # Every generated group (what the policy did), with the advantages it trained on where `used`.
        trained_rows = {row["group_uid"]: row for row in rows}
        table = _rollouts([trained_rows.get(row["group_uid"], row) for row in generated], step, dropped)
        metrics = {
            "step": step,
            **_reward_metrics(table, self.success_threshold),
            **_rank_metrics(results),
            **_timing_metrics(rows, waited, start, end),
            "trainer_idle_fraction": waited / max(waited + end - start, 1e-9),
            "trainer_idle_fraction_cum": self.idle_seconds / max(self.idle_seconds + self.busy_seconds, 1e-9),
            "policy_version": step + 1,  # one version per train step, however many optimizer steps it took
            "duplicate_groups": self.duplicates,
            "overlong_shaped": int(sum(row.get("overlong_shaped", 0) for row in rows)),
            **({"dynamic_sampling_zero_variance": sum(r == "zero_variance" for r in dropped.values()),
                "dynamic_sampling_surplus": sum(r == "surplus" for r in dropped.values()),
                "dynamic_sampling_topped_up": sum(not _informative(row) for row in rows)}
               if self.dynamic_sampling else {}),
            **(_critic_metrics(critic_results, rows) if critic_results else {}),
        }
        self.ledger.append(_ledger_rows(table, trained=not metrics.get("nonfinite_skipped")))
        if metrics.get("nonfinite_skipped"):
            self.nan_skips += 1
            if self.max_nan_skips is not None and self.nan_skips > self.max_nan_skips:
                from operators.workers.train_worker import NonFiniteError

                raise NonFiniteError(
                    f"{self.nan_skips} steps had a non-finite loss (train.max_nan_skips: {self.max_nan_skips}); "
                    "stopping. Lower train.lr, check the rewards, or raise train.max_nan_skips"
                )
        rollouts = {"rollouts_parquet": _to_parquet(table)}
        if self.rollouts_dir is not None:
            path = self.rollouts_dir / f"step_{step:06d}.parquet"
            write_atomic(path, rollouts.pop("rollouts_parquet"), what=f"the rollouts of step {step + 1}")
            rollouts["rollouts_path"] = str(path)
        # What the checkpoint keeps of this step's row, for a driver that dies before logging it.
        self.unsaved_rows.append({**{key: value.item() if isinstance(value, np.generic) else value
                                     for key, value in metrics.items()
                                     if isinstance(value, (int, float, bool, np.integer, np.floating))},
                                  **{key: value for key, value in rollouts.items() if key == "rollouts_path"}})
        checkpoint_start = time.perf_counter()
        stopping = self.stop is not None and step + 1 < self.end_step and self.stop.requested()
        checkpoint = self._maybe_checkpoint(step + 1, force=stopping)
        self.stopped = stopping
        metrics["stopped"] = bool(stopping)  # a graceful stop was asked for: this step is the last one trained
        metrics["time_checkpoint"] = time.perf_counter() - checkpoint_start  # trainer blocked while it writes
        # Busy intervals (wall clock) of this step's work, for overlap analysis (pipelines/tracking/timeline.py);
        # a JSON string so it travels as a plain Arrow column and is not logged as a metric.
        timeline = json.dumps({"train": (wall_start, wall_start + end - start), "generate": _generate_intervals(rows),
                               "stamps": _stamps(generated)})
        return pd.DataFrame([{
            **metrics, "timeline": timeline, **rollouts,
            "checkpoint_path": str(checkpoint) if checkpoint else None,
        }])

    def _critic_calls(self, samples: dict, critic_samples: dict, global_tokens: int, global_sequences: int) -> list:
        if not self.critics:
            return []
        if "returns" not in critic_samples:
            raise ValueError("a critic needs rows with `returns` and `values`: put the Value stage before a token "
                             "estimator (algorithm.advantage: gae)")
        return [critic.train_step.remote(shard, global_tokens, global_sequences)
                for critic, shard in zip(self.critics, _shard(critic_samples, len(self.critics),
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


def _informative(row: dict) -> bool:
    """A group teaches something when its rewards differ (GRPO-style advantages are all 0 otherwise)."""
    return float(np.ptp(np.asarray(row["rewards"], dtype=float))) > 0


def select_informative(rows: list[dict], count: int) -> tuple[list[dict], dict[str, str]]:
    """DAPO dynamic sampling: the first `count` groups (in the given, schedule order) whose rewards
    differ; if fewer differ, topped up with the first zero-variance ones, so every step trains the
    same number of samples. Returns the rows kept and, per group_uid left out, why:
    "zero_variance" (no learning signal) or "surplus" (informative, but `count` were already kept)."""
    informative = [row for row in rows if _informative(row)]
    flat = [row for row in rows if not _informative(row)]
    kept = informative[:count] + flat[:max(0, count - len(informative))]
    kept_ids = {id(row) for row in kept}
    dropped = {str(row["group_uid"]): "surplus" if _informative(row) else "zero_variance"
               for row in rows if id(row) not in kept_ids}
    order = {id(row): index for index, row in enumerate(rows)}
    return sorted(kept, key=lambda row: order[id(row)]), dropped


def _explode(rows: list[dict]) -> dict[str, list]:
    """Groups -> samples: one entry per response, in group order.

    An advantage stays a float (one per response) or a list (one per response token, e.g. GAE).
    `staleness` (train_step - policy_version; 0 for a row without it) goes with every sample, and
    `ref_logprobs` (one per response token) when the rows carry that column (None for a row
    without it: the trainer refuses a KL term then); `returns` and `old_values` (the Value
    stage's `values`), one per response token, when the rows carry returns (for the critic)."""
    samples = defaultdict(list)
    with_ref = any(row.get("ref_logprobs") is not None for row in rows)
    with_masks = any(row.get("loss_masks") is not None for row in rows)
    with_returns = all(row.get("returns") is not None for row in rows)
    for row in rows:
        for index, response in enumerate(row["response_token_ids"]):
            samples["prompt_token_ids"].append(list(row["prompt_token_ids"]))
            samples["response_token_ids"].append(list(response))
            samples["behavior_logprobs"].append(list(row["behavior_logprobs"][index]))
            advantage = row["advantages"][index]
            samples["advantages"].append(float(advantage) if np.ndim(advantage) == 0 else
                                         [float(value) for value in advantage])
            samples["staleness"].append(_response_staleness(row, index))
            if with_masks:  # multi-turn: observation tokens carry no loss
                masks = row.get("loss_masks")
                samples["loss_masks"].append(None if masks is None else [int(m) for m in masks[index]])
            if with_ref:
                refs = row.get("ref_logprobs")
                samples["ref_logprobs"].append(None if refs is None else [float(v) for v in refs[index]])
            if with_returns:
                samples["returns"].append([float(v) for v in row["returns"][index]])
                samples["old_values"].append([float(v) for v in row["values"][index]])
                samples["critic_version"].append(int(row.get("critic_version", -1)))
    return dict(samples)


def split_critic_samples(samples: dict) -> dict:
    """Take the critic's columns out of the step's samples (`_explode`'s) and return the critic's samples:
    the sequences, the return targets, the Value stage's values and critic versions, and the policy's loss
    masks: the critic is trained on the policy's tokens only (an observation is not a state the policy acts
    from), under the policy's normaliser. {} when the samples carry no returns."""
    critic = {key: samples.pop(key) for key in ("returns", "old_values", "critic_version") if key in samples}
    if not critic:
        return {}
    return {"prompt_token_ids": samples["prompt_token_ids"], "response_token_ids": samples["response_token_ids"],
            **critic, **({"loss_masks": samples["loss_masks"]} if "loss_masks" in samples else {})}


def step_normalisers(samples: dict) -> tuple[int, int]:
    """The step's loss normalisers over all ranks: its trained tokens, and its responses with at least one
    (an episode whose every token is an observation trains nothing and is not counted, as the ranks' own
    count for several mini-batches leaves it out: TrainWorker._global_counts)."""
    counts = [trained_tokens(samples, i) for i in range(len(samples["response_token_ids"]))]
    return sum(counts), sum(1 for count in counts if count)


def _token_masks(row: dict) -> list[list[int]]:
    """Per response of a group, 1 at each token the loss trains: its loss mask (multi-turn), else all 1s."""
    masks = row.get("loss_masks")
    if masks is not None:
        return [[int(m) for m in mask] for mask in masks]
    return [[1] * len(response) for response in row["response_token_ids"]]


def _response_staleness(row: dict, index: int) -> int:
    """train_step - the oldest version that sampled a token of response `index` (partial rollout: the
    response's own tokens; otherwise the group's one version)."""
    staleness = int(row.get("staleness", 0))
    versions = row.get("token_policy_versions")
    if versions is None or "policy_version" not in row or not len(versions[index]):
        return staleness
    return staleness + int(row["policy_version"]) - int(min(versions[index]))


def _generate_intervals(rows: list[dict]) -> list[tuple[str, float, float]]:
    """Distinct generate calls that produced these rows: (generator id, start, end)."""
    calls = {
        (row["generator_id"], float(row["generate_start"]), float(row["generate_end"]))
        for row in rows if row.get("generate_start") is not None
    }
    return sorted(calls, key=lambda call: call[1])


def _stamps(rows: list[dict]) -> dict[str, list]:
    """Per stamp, its value for each group of the step (None where a row lacks it)."""
    def value(row: dict, name: str) -> float | None:
        stamp = row.get(name)
        return None if stamp is None or pd.isna(stamp) else float(stamp)

    return {name: [value(row, name) for row in rows] for name in STAMPS}


def _shard(samples: dict[str, list], world_size: int, equal_counts: bool = False) -> list[dict[str, list]]:
    """The step's samples dealt to the ranks by tokens (prompt + response, what a rank computes on):
    token counts within one sample of each other; `equal_counts` (several mini-batches per rank) keeps
    the sample counts equal instead (operators.algorithms.batching.balanced_shards)."""
    from operators.algorithms.batching import balanced_shards

    lengths = [len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"])]
    return [{key: [values[i] for i in shard] for key, values in samples.items()}
            for shard in balanced_shards(lengths, world_size, equal_counts)]


def _rollouts(rows: list[dict], step: int, dropped: dict[str, str] | None = None) -> pd.DataFrame:
    """The step's groups as the rollouts Parquet and the ledger hold them; `dropped`: group_uid ->
    why dynamic sampling left it out of the update (the others are `used`)."""
    dropped = dropped or {}
    table = pd.DataFrame(rows)
    table["dropped"] = [dropped.get(str(uid)) for uid in table.get("group_uid", [None] * len(table))]
    table["used"] = table["dropped"].isna()
    table["train_step"] = step
    table["staleness"] = step - table["policy_version"].astype(int)
    if "policy_version_max" not in table.columns:  # one version per group (call-synchronous engines)
        table["policy_version_max"] = table["policy_version"]
    if "token_policy_versions" not in table.columns:
        table["token_policy_versions"] = [[[int(version)] * int(length) for length in lengths] for version, lengths
                                          in zip(table["policy_version"], table["response_lengths"])]
    for column in ROLLOUT_COLUMNS:
        if column not in table.columns:
            table[column] = None
    for column in ("responses", "response_lengths", "rewards", "advantages"):
        table[column] = table[column].map(list)
    # chat messages arrive as numpy arrays of dicts (Arrow list<struct> in a pandas batch)
    table["prompt"] = table["prompt"].map(lambda cell: cell.tolist() if hasattr(cell, "tolist") else cell)
    table["response_token_ids"] = table["response_token_ids"].map(
        lambda cell: None if cell is None else [[int(t) for t in response] for response in cell])
    table["token_policy_versions"] = table["token_policy_versions"].map(
        lambda cell: [[int(v) for v in response] for response in cell])
    critic = [column for column in CRITIC_COLUMNS if column in table.columns]
    for column in set(critic) - {"critic_version"}:
        table[column] = table[column].map(lambda cell: [[float(v) for v in response] for response in cell])
    episodes = [column for column in EPISODE_COLUMNS if column in table.columns]
    for column in set(episodes) & {"turns", "num_turns", "episode_ends", "env_rewards"}:
        table[column] = table[column].map(list)
    if "loss_masks" in episodes:
        table["loss_masks"] = table["loss_masks"].map(lambda cell: [[int(m) for m in mask] for mask in cell])
    return table[ROLLOUT_COLUMNS + critic + episodes]


# The ledger: one row per group a step consumed, the record exactly-once resume and `streamrl lineage`
# read (checkpoints carry it: pipelines/recovery/checkpoint.py). `used`: the group was in its step's update (dynamic
# sampling leaves some out, `dropped` says why: zero_variance or surplus); `trained`: the step's update was
# applied (not skipped for a non-finite loss). `policy_version` / `policy_version_max`: the oldest / newest
# version that sampled a token of the group. `generator_id`: the generate actor that sampled it (host:pid), so
# a fault or an autoscaled pool can be traced to the actor (empty in ledgers written before it was kept).
LEDGER_COLUMNS = ["train_step", "group_uid", "prompt_id", "epoch", "policy_version", "policy_version_max", "staleness",
                  "trained", "used", "dropped", "generator_id"]


def _ledger_rows(table: pd.DataFrame, trained: bool) -> pd.DataFrame:
    """The ledger's record of one step: which groups (prompt ids, policy versions) it consumed."""
    rows = table.assign(trained=trained)
    rows["epoch"] = rows["epoch"].astype("Int64")
    return rows.reindex(columns=LEDGER_COLUMNS).reset_index(drop=True)


def _reward_metrics(table: pd.DataFrame, success_threshold: float) -> dict:
    rewards = np.concatenate([np.asarray(r, dtype=float) for r in table["rewards"]])
    lengths = np.concatenate([np.asarray(l, dtype=float) for l in table["response_lengths"]])
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "success_rate": float((rewards >= success_threshold).mean()),
        "response_length_mean": float(lengths.mean()),
        "generated_tokens": int(lengths.sum()),
        "reward_errors": int(table["reward_errors"].sum()),
        "reward_timeouts": int(table["reward_timeouts"].sum()),
        "staleness_mean": float(table["staleness"].mean()),
        "staleness_max": int(table["staleness"].max()),
        "num_groups": len(table),
        **_episode_metrics(table),
    }


def _episode_metrics(table: pd.DataFrame) -> dict:
    """Multi-turn steps: turns per episode, tool calls and their errors, environment errors, and the
    share of the response tokens that are the policy's (the rest are observations, not trained)."""
    if "num_turns" not in table.columns:
        return {}
    turns = np.concatenate([np.asarray(t, dtype=float) for t in table["num_turns"]])
    policy = sum(sum(sum(mask) for mask in masks) for masks in table["loss_masks"]) if "loss_masks" in table else 0
    tokens = sum(sum(lengths) for lengths in table["response_lengths"])
    ends = [end for cell in table["episode_ends"] for end in cell]
    return {
        "turns_mean": float(turns.mean()),
        "tool_calls": int(table["tool_calls"].sum()),
        "tool_errors": int(table["tool_errors"].sum()),
        "env_errors": int(table["env_errors"].sum()),
        "policy_token_share": float(policy / tokens) if tokens else 1.0,
        "episodes_cut": sum(end in ("max_turns", "token_budget") for end in ends),  # by a limit, not by the model
    }


# Per-rank figures merged by hand in _rank_metrics; every other float is a token-weighted loss statistic.
_RANK_SPECIAL = {"num_tokens", "policy_loss", "grad_norm", "grad_norm_last", "train_seconds", "publish_seconds",
                 "nonfinite_skipped", "mismatch", "micro_batches", "optimizer_steps", "empty_updates"}


def _rank_metrics(results: list[dict]) -> dict:
    """Merge the ranks' figures: token-weighted means of the loss statistics (*_max: maximum,
    *_min: minimum), the mismatch statistics from their sums (operators.algorithms.correction.merge_mismatch),
    the mean loss, rank 0's gradient norms (global after DeepSpeed's all-reduce), the slowest time."""
    from operators.algorithms.correction import merge_mismatch

    tokens = np.array([r["num_tokens"] for r in results], dtype=float)
    weights = tokens / max(tokens.sum(), 1.0)
    merged = {}
    for key in [key for key in results[0] if key not in _RANK_SPECIAL]:
        values = [float(r[key]) for r in results]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        else:
            merged[key] = float(sum(w * v for w, v in zip(weights, values)))
    merged.update(merge_mismatch([part for r in results for part in r["mismatch"]]))
    merged["policy_loss"] = float(np.mean([r["policy_loss"] for r in results]))
    merged["grad_norm"] = float(results[0]["grad_norm"])
    merged["grad_norm_last"] = float(results[0]["grad_norm_last"])
    merged["optimizer_steps"] = int(results[0]["optimizer_steps"])
    merged["empty_updates"] = int(results[0].get("empty_updates", 0))  # the ranks skip together
    merged["time_train"] = float(max(r["train_seconds"] for r in results))
    merged["time_publish"] = float(results[0]["publish_seconds"])
    merged["nonfinite_skipped"] = int(max(r.get("nonfinite_skipped", 0) for r in results))
    return merged


def _critic_metrics(results: list[dict], rows: list[dict]) -> dict:
    """The critic's step: its ranks' loss statistics (token-weighted), and over every response token of
    the step the values it was trained from, the return targets and how much of their variance the
    values explain (1 - Var(R - V) / Var(R): 1 is perfect, 0 no better than a constant)."""
    tokens = np.array([r["num_tokens"] for r in results], dtype=float)
    weights = tokens / max(tokens.sum(), 1.0)
    values = np.concatenate([np.asarray(v, dtype=float) for row in rows for v in row["values"]] or [np.zeros(0)])
    returns = np.concatenate([np.asarray(v, dtype=float) for row in rows for v in row["returns"]] or [np.zeros(0)])
    variance = returns.var() if returns.size else 0.0
    return {
        **{key: float(sum(w * r[key] for w, r in zip(weights, results)))
           for key in ("value_loss", "value_clip_fraction") if key in results[0]},
        "explained_variance": float(1.0 - (returns - values).var() / variance) if variance > 0 else float("nan"),
        "value_mean": float(values.mean()) if values.size else float("nan"),
        "return_mean": float(returns.mean()) if returns.size else float("nan"),
        "critic_version": int(min(int(row["critic_version"]) for row in rows)),  # the oldest critic of the step
        "critic_grad_norm": float(results[0]["grad_norm"]),
        "critic_nonfinite_skipped": int(max(r["nonfinite_skipped"] for r in results)),
        # samples whose V_old the critic recomputed: the Value stage's critic was older than the trained one
        "critic_stale_values": int(sum(r.get("stale_values_refreshed", 0) for r in results)),
        "time_value": float(sum(row.get("time_value", 0.0) for row in rows)),
        "time_critic": float(max(r["train_seconds"] for r in results)),
        "time_critic_publish": float(results[0]["publish_seconds"]),
    }


def _timing_metrics(rows: list[dict], waited: float, start: float, end: float) -> dict:
    timings = {f"time_{stage}": float(sum(row.get(f"time_{stage}", 0.0) for row in rows)) for stage in STAGES}
    tokens = sum(sum(row["response_lengths"]) for row in rows)
    step_wall = waited + (end - start)
    return {**timings, "time_wait": waited, "step_seconds": step_wall, "tokens_per_s": tokens / max(step_wall, 1e-9)}


def _to_parquet(table: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    table.to_parquet(buffer, index=False)
    return buffer.getvalue()
