"""Reward operator: scores every response of a prompt group with weighted reward functions.

A reward function takes the completions and the dataset's columns as keyword lists aligned
with them (TRL's convention) and returns one float (or None) per completion:

    def my_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]: ...

Builtins are registered by name; anything else is named 'package.module:function'.
A function that raises, or returns None for a sample, never kills the job: the affected
samples get `on_error` and are counted in the `reward_errors` column.
"""

from __future__ import annotations

import importlib
import inspect
import time
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from operators.registry import Registry

RewardFn = Callable[..., Sequence[float | None]]
REWARD_FUNCTIONS = Registry("reward function")

# Columns the pipeline adds; everything else in a row is a dataset column passed to rewards.
PIPELINE_COLUMNS = frozenset({
    "responses", "response_token_ids", "behavior_logprobs", "prompt_token_ids", "response_lengths",
    "policy_version", "group_uid", "train_step", "rewards", "advantages", "reward_errors",
    "generator_id", "generate_start", "generate_end",
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


@REWARD_FUNCTIONS.register("exact_match")
def exact_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the stripped completion equals the stripped `answer`, else 0.0."""
    return [float(text.strip() == str(target).strip()) for text, target in zip(completions, answer)]


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


def _as_score(value) -> float:
    """A finite float, or NaN for None, non-numbers and infinities."""
    try:
        return float(value) if value is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _call_kwargs(fn: RewardFn, columns: dict[str, list]) -> dict[str, list]:
    """Pass all dataset columns to a **kwargs function, else only the ones it names."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params}
    return {key: value for key, value in columns.items() if key in names}


class Reward:
    """Callable class for `Dataset.map_batches`: adds `rewards` (list of n floats per row).

    Also adds `reward_errors` (samples that fell back to `on_error`), one list column
    `reward_<name>` per function, and `time_reward` (seconds of this call per row).
    """

    def __init__(self, functions: Sequence[tuple[str, float]] = (("arithmetic_exact", 1.0),), on_error: float = 0.0):
        self.functions = [(name, float(weight), resolve_reward_function(name)) for name, weight in functions]
        self.on_error = float(on_error)

    def _score(self, fn: RewardFn, completions: list[str], columns: dict[str, list]) -> tuple[np.ndarray, np.ndarray]:
        """Scores and an error mask; a failing batch call is retried sample by sample."""
        kwargs = _call_kwargs(fn, columns)
        try:
            values = list(fn(completions, **kwargs))
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} scores for {len(completions)} completions")
        except Exception:
            values = []
            for index, completion in enumerate(completions):
                try:
                    values.append(fn([completion], **{k: [v[index]] for k, v in kwargs.items()})[0])
                except Exception:
                    values.append(None)
        scores = np.array([_as_score(value) for value in values], dtype=float)  # NaN marks a failure
        failed = ~np.isfinite(scores)
        scores[failed] = self.on_error
        return scores, failed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        start = time.perf_counter()
        batch = batch.copy()
        if batch.empty:
            for column in ("rewards", "reward_errors", "time_reward"):
                batch[column] = []
            return batch
        sizes = [len(responses) for responses in batch["responses"]]
        completions = [str(text) for responses in batch["responses"] for text in responses]
        columns = {
            column: [value for value, size in zip(batch[column], sizes) for _ in range(size)]
            for column in batch.columns
            if column not in PIPELINE_COLUMNS and not column.startswith(("time_", "reward_"))
        }
        total = np.zeros(len(completions))
        errors = np.zeros(len(completions), dtype=bool)
        splits = np.cumsum(sizes)[:-1]
        for name, weight, fn in self.functions:
            scores, failed = self._score(fn, completions, columns)
            total += weight * scores
            errors |= failed
            batch[f"reward_{name.replace(':', '.')}"] = [part.tolist() for part in np.split(scores, splits)]
        batch["rewards"] = [part.tolist() for part in np.split(total, splits)]
        batch["reward_errors"] = [int(part.sum()) for part in np.split(errors, splits)]
        batch["time_reward"] = (time.perf_counter() - start) / max(len(batch), 1)
        return batch
