"""Reward operator: scores every response of a prompt group with weighted reward functions.

A reward function takes the completions and the dataset's columns as keyword lists aligned
with them and returns one float (or None) per completion:

    def my_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]: ...

Functions written for TRL's GRPOTrainer (`prompts`, `completions`, `completion_ids` and the columns as
keyword arguments; completions as messages for conversational prompts; None for "not applicable") work
unchanged; `async def` works in both styles. How each style is called is operators/stages/reward_calls.py.

Builtins are registered by name; anything else is named 'package.module:function'. Which
dataset columns a function takes is read from its signature (`call_problem`): the check of a
job's inputs refuses one that takes a column the dataset lacks before anything starts.
A function that raises, or (streamrl style) returns None for a sample, does not kill the batch: the
affected samples get `on_error` and are counted in the `reward_errors` column. A function that raises
on every sample is named in `reward_raised` with its exception, and the Train stage stops the
job when one does so for `reward.stop_after_failed_steps` steps in a row (`FailedRewardSteps`):
a job must not train on `on_error` alone. With a timeout the functions run in a sandbox child
process (operators/environments/sandbox.py), so one that hangs or runs away costs its batch
`on_error` (counted in `reward_timeouts` when it hung), not the job.

Multi-turn rows (operators/environments/environment.py) carry `env_rewards`, the environment's own rewards per
episode: they are added to the functions' sum.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from operators.algorithms.registry import Registry
from operators.environments.sandbox import Sandbox, SandboxLimits
from operators.stages.reward_calls import (
    RewardFn, call_kwargs, reward_style, score_values, scores_from_reply, style_columns, trl_arguments,
)

if TYPE_CHECKING:
    import pandas as pd  # not imported at run time: the sandbox child starts faster without it

REWARD_FUNCTIONS = Registry("reward function")

# Columns the pipeline adds; everything else in a row is a dataset column passed to rewards.
PIPELINE_COLUMNS = frozenset({
    "responses", "response_token_ids", "behavior_logprobs", "prompt_token_ids", "prompt_text", "response_lengths",
    "policy_version", "group_uid", "train_step", "rewards", "advantages", "reward_errors", "reward_timeouts",
    "generator_id", "generate_start", "generate_end", "policy_version_max", "token_policy_versions",
    # multi-turn episodes (operators/environments/environment.py)
    "loss_masks", "turns", "num_turns", "episode_ends", "env_rewards", "tool_calls", "tool_errors", "env_errors",
})


def _leading_number(text: str) -> str:
    """The answer a model gave: leading characters up to the first that is not a digit or '-'."""
    text = text.strip()
    end = 0
    while end < len(text) and (text[end].isdigit() or text[end] == "-"):
        end += 1
    return text[:end]


@REWARD_FUNCTIONS.register("arithmetic_exact")
def arithmetic_exact(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the number the completion starts with equals `answer`, else 0.0."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [float(_leading_number(text) == str(target).strip()) for text, target in zip(completions, answer)]


@REWARD_FUNCTIONS.register("tool_answer_exact")
def tool_answer_exact(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """A tool episode's answer (operators/environments/environment.py, ToolEnvironment): 1.0 when the number after the
    last tool result (`}`), or at the start of a completion with none, equals `answer`."""
    if len(completions) != len(answer):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [float(_leading_number(text.rpartition("}")[2]) == str(target).strip())
            for text, target in zip(completions, answer)]


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the stripped completion equals the stripped `answer`, else 0.0."""
    return [float(text.strip() == str(target).strip()) for text, target in zip(completions, answer)]


# The next two read the answer in the one declared format, operators/task_answers.ANSWER_FORMAT (a sentence
# 'The answer is N.'; the last one counts), which data.system_prompt asks for (task_answers.SYSTEM_PROMPT).
@REWARD_FUNCTIONS.register("reasoning_gym")
def reasoning_gym(completions: list[str], rg_task: list[str], rg_entry: list[str], **kwargs) -> list[float]:
    """A reasoning_gym:<task> dataset's own score (`score_answer`, in [0, 1]) of the answer the completion
    states; 0.0 when it states none. Needs the columns rg_task, rg_entry (and rg_options) that
    pipelines/data/reasoning_tasks.py makes."""
    from operators.common.task_answers import reasoning_gym_scores

    return reasoning_gym_scores(completions, rg_task, rg_entry, kwargs.get("rg_options"))


@REWARD_FUNCTIONS.register("answer_format")
def answer_format(completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion states an answer in the declared format, else 0.0 (right or wrong)."""
    from operators.common.task_answers import format_scores

    return format_scores(completions)


def resolve_reward_function(name: str) -> RewardFn:
    """A builtin by name, or 'module:function'. Raises with the fix in the message."""
    if ":" not in name:
        return REWARD_FUNCTIONS.get(name)
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"cannot import module {module_name!r} of reward function {name!r} ({err}); "
            "make it importable (installed, or on PYTHONPATH) or use a builtin name"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}; check the function name")
    if not callable(fn):
        raise TypeError(f"{name!r} is not callable; it must be a function (completions, **columns) -> list[float]")
    return fn


def reward_columns(columns: Collection[str]) -> set[str]:
    """The columns of a row a reward function may take: every column but the pipeline's and the stages'
    timings and rewards."""
    return {column for column in columns
            if column not in PIPELINE_COLUMNS and not column.startswith(("time_", "reward_"))}


class RewardFunctionError(RuntimeError):
    """A reward function raised on every sample of `reward.stop_after_failed_steps` train steps in a row."""


def failing_functions(rows: Sequence[dict]) -> dict[str, str]:
    """The reward functions that raised on every sample of these rows (a step's groups: their `reward_raised`),
    each with its exception."""
    found = [json.loads(row.get("reward_raised") or "{}") for row in rows]
    if not found:
        return {}
    names = set.intersection(*(set(each) for each in found))
    return {name: found[0][name] for name in sorted(names)}


class FailedRewardSteps:
    """The Train stage's watch on reward functions: counts, per function, the steps in a row whose every sample
    it raised on, warns, and at `stop_after` raises RewardFunctionError (naming it and its exception) before
    that step trains."""

    def __init__(self, stop_after: int = 1):
        if stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {stop_after}")
        self.stop_after = stop_after
        self.in_a_row: dict[str, int] = {}

    def check(self, step: int, rows: Sequence[dict]) -> None:
        """`step`: the step's 0-based index (users read step + 1)."""
        failed = failing_functions(rows)
        self.in_a_row = {name: self.in_a_row.get(name, 0) + 1 for name in failed}
        for name, exception in failed.items():
            count = self.in_a_row[name]
            steps = f"step {step + 1}" + (f" and the {count - 1} step(s) before it" if count > 1 else "")
            if count >= self.stop_after:
                # one line the job's failure line shows whole (it keeps 300 characters, the class name included)
                head = f"reward function {name!r} raised on every sample of {steps} ("
                tail = f"); fix it, or raise reward.stop_after_failed_steps ({self.stop_after})"
                room = max(40, 230 - len(head) - len(tail))
                short = exception if len(exception) <= room else exception[:room].rsplit(" ", 1)[0] + " ..."
                raise RewardFunctionError(head + short + tail)
            print(f"streamrl: WARNING reward function {name!r} raised on every sample of {steps} ({exception}); "
                  f"its samples get reward.on_error; the job stops at {self.stop_after} such steps in a row "
                  "(reward.stop_after_failed_steps)", file=sys.stderr, flush=True)


class Reward:
    """Callable class for `Dataset.map_batches`: adds `rewards` (list of n floats per row).

    Also adds `reward_errors` (samples that fell back to `on_error`), `reward_timeouts` (samples
    whose function call ran over `timeout_s`; they count in `reward_errors` too), `reward_raised` (JSON
    text: the functions that raised on every sample of the call, each with its exception), one list
    column `reward_<name>` per function, and `time_reward` (seconds of this call per row). With
    `timestamps=True`, also the call's wall-clock interval `reward_start`, `reward_end` (the RL
    pipeline's, from which benchmarks/loop_latency.py measures the hops between stages).

    `timeout_s` > 0 runs the functions in a sandbox child process (operators/environments/sandbox.py, with
    `limits`), started on the first call and reused: a call (one function, the whole batch) that does not
    answer within `timeout_s` has its child killed and replaced, and that function's samples
    of the batch get `on_error` (no sample-by-sample retry, which could cost n x timeout).
    The child imports the functions by name, so each must be importable ('module:function' on
    the path, or a builtin); config validation checks that. `timeout_s=0` runs them in this
    process with no limit. A function that raises is retried sample by sample either way.
    """

    def __init__(
        self, functions: Sequence[tuple] = (("arithmetic_exact", 1.0),), on_error: float = 0.0,
        timeout_s: float = 0.0, timestamps: bool = False, limits: SandboxLimits = SandboxLimits(),
    ):
        """`functions`: (name, weight) or (name, weight, style), style 'auto', 'streamrl' or 'trl'
        (operators/stages/reward_calls.py)."""
        self.timestamps = timestamps
        self.functions = []
        for name, weight, *style in functions:
            fn = resolve_reward_function(name)
            self.functions.append((name, float(weight), fn, reward_style(fn, *style)))
        self.on_error = float(on_error)
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0: no limit), got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.sandbox = (Sandbox([name for name, *_ in self.functions], "reward", limits)
                        if self.timeout_s > 0 and self.functions else None)

    def close(self) -> None:
        """Stop the sandbox process now (it is also stopped when this object is collected)."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _score(self, name: str, fn: RewardFn, style: str, completions: list, columns: dict[str, list]):
        """Scores, a failure mask, whether the call timed out, and the exception when it raised on every sample.
        A trl-style None ("does not apply") scores 0 and is no failure."""
        kwargs = call_kwargs(fn, columns)
        timed_out = False
        returned_none = np.zeros(len(completions), dtype=bool)
        if self.sandbox is None:
            scores, returned_none, raised = score_values(fn, completions, kwargs)
        else:
            reply, problem = self.sandbox.call(name, completions, kwargs, self.timeout_s)
            scores, raised = None, None
            if problem is None:
                try:
                    scores, returned_none, raised = scores_from_reply(reply, len(completions))
                except ValueError as err:
                    problem = str(err)
            if scores is None:
                timed_out = problem == "timeout"
                what = (f"did not answer within {self.timeout_s:g}s; killed its sandbox process" if timed_out
                        else f"failed: {problem}")
                print(
                    f"streamrl: WARNING reward function {name!r} {what}; "
                    f"{len(completions)} samples get on_error={self.on_error:g}",
                    file=sys.stderr, flush=True,
                )
                scores = np.full(len(completions), np.nan)
        missing = ~np.isfinite(scores)
        failed = missing & ~returned_none if style == "trl" else missing
        scores = np.where(failed, self.on_error, np.where(missing, 0.0, scores))
        return scores, failed, timed_out, raised

    def _arguments(self, batch: pd.DataFrame, style: str, sizes: list[int]) -> tuple[list, dict[str, list]]:
        """The completions and the keyword lists a function of `style` is offered, one entry per completion."""
        completions = [str(text) for responses in batch["responses"] for text in responses]
        columns = {column: [value for value, size in zip(batch[column], sizes) for _ in range(size)]
                   for column in style_columns(reward_columns(batch.columns), style) if column in batch.columns}
        if style == "trl":
            prompts = [value for value, size in zip(batch["prompt"], sizes) for _ in range(size)] \
                if "prompt" in batch.columns else [None] * len(completions)
            ids = [each for row in batch["response_token_ids"] for each in row] \
                if "response_token_ids" in batch.columns else [[] for _ in completions]
            completions, extra = trl_arguments(prompts, completions, ids)
            columns.update(extra)
        return completions, columns

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        wall_start = time.time()
        start = time.perf_counter()
        batch = batch.copy()
        if batch.empty:
            for column in ("rewards", "reward_errors", "reward_timeouts", "reward_raised", "time_reward"):
                batch[column] = []
            return batch
        sizes = [len(responses) for responses in batch["responses"]]
        arguments = {style: self._arguments(batch, style, sizes) for style in {s for *_, s in self.functions}}
        size = sum(sizes)
        total = np.zeros(size)
        errors = np.zeros(size, dtype=bool)
        timeouts = np.zeros(size, dtype=bool)
        splits = np.cumsum(sizes)[:-1]
        raised_by: dict[str, str] = {}  # the functions that raised on every sample of the batch
        for name, weight, fn, style in self.functions:
            scores, failed, timed_out, raised = self._score(name, fn, style, *arguments[style])
            if raised is not None:
                raised_by[name] = raised
            total += weight * scores
            errors |= failed
            timeouts |= timed_out
            batch[f"reward_{name.replace(':', '.')}"] = [part.tolist() for part in np.split(scores, splits)]
        if "env_rewards" in batch.columns:  # multi-turn episodes: the environment's rewards count too
            total += np.array([float(value) for values in batch["env_rewards"] for value in values])
        batch["rewards"] = [part.tolist() for part in np.split(total, splits)]
        batch["reward_errors"] = [int(part.sum()) for part in np.split(errors, splits)]
        batch["reward_timeouts"] = [int(part.sum()) for part in np.split(timeouts, splits)]
        batch["reward_raised"] = json.dumps(raised_by)  # JSON text: one type in every block
        batch["time_reward"] = (time.perf_counter() - start) / max(len(batch), 1)
        if self.timestamps:
            batch["reward_start"], batch["reward_end"] = wall_start, time.time()
        return batch
