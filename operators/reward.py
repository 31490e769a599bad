"""Reward operator: scores every response of a prompt group with weighted reward functions.

A reward function takes the completions and the dataset's columns as keyword lists aligned
with them (TRL's convention) and returns one float (or None) per completion:

    def my_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]: ...

Builtins are registered by name; anything else is named 'package.module:function'.
A function that raises, or returns None for a sample, never kills the job: the affected
samples get `on_error` and are counted in the `reward_errors` column. With a timeout the
functions run in a sandbox child process, so one that hangs costs its batch `on_error`
(counted in `reward_timeouts`), not the job.

Multi-turn rows (operators/environment.py) carry `env_rewards`, the environment's own rewards per
episode: they are added to the functions' sum.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from operators.registry import Registry

if TYPE_CHECKING:
    import pandas as pd  # not imported at run time: the sandbox child starts faster without it

RewardFn = Callable[..., Sequence[float | None]]
REWARD_FUNCTIONS = Registry("reward function")

# Columns the pipeline adds; everything else in a row is a dataset column passed to rewards.
PIPELINE_COLUMNS = frozenset({
    "responses", "response_token_ids", "behavior_logprobs", "prompt_token_ids", "prompt_text", "response_lengths",
    "policy_version", "group_uid", "train_step", "rewards", "advantages", "reward_errors", "reward_timeouts",
    "generator_id", "generate_start", "generate_end", "policy_version_max", "token_policy_versions",
    # multi-turn episodes (operators/environment.py)
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
    """A tool episode's answer (operators/environment.py, ToolEnvironment): 1.0 when the number after the
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
    pipelines/reasoning_tasks.py makes."""
    from operators.task_answers import reasoning_gym_scores

    return reasoning_gym_scores(completions, rg_task, rg_entry, kwargs.get("rg_options"))


@REWARD_FUNCTIONS.register("answer_format")
def answer_format(completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion states an answer in the declared format, else 0.0 (right or wrong)."""
    from operators.task_answers import format_scores

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


def score_values(fn: RewardFn, completions: list[str], kwargs: dict[str, list]) -> np.ndarray:
    """One score per completion, NaN where the function failed; a failing batch call is retried
    sample by sample, so one bad sample does not cost the others their scores."""
    try:
        values = list(fn(completions, **kwargs))
        if len(values) != len(completions):
            raise ValueError(f"returned {len(values)} scores for {len(completions)} completions")
    except Exception:  # noqa: BLE001 - any failure of user code is contained
        values = []
        for index, completion in enumerate(completions):
            try:
                values.append(fn([completion], **{k: [v[index]] for k, v in kwargs.items()})[0])
            except Exception:  # noqa: BLE001
                values.append(None)
    return np.array([_as_score(value) for value in values], dtype=float)


# --- the sandbox: reward functions in a child process, killed when a call runs over -------


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the parent goes away, even in the middle of a hung call (a Ray actor may be
    SIGKILLed, which runs no cleanup): the kernel's parent-death signal on Linux, and a thread
    that polls the parent pid everywhere."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _sandbox_main(conn, names: list[str], parent_pid: int, kind: str = "reward") -> None:
    """The child: resolve the functions once, then answer each call. `kind` "reward": (name,
    completions, kwargs) -> scores; "tool" (operators/environment.py): (name, args, kwargs) -> the
    tool's result, which must be a string."""
    _die_with_parent(parent_pid)
    try:
        if kind == "tool":
            from operators.environment import resolve_tool as resolve
        else:
            resolve = resolve_reward_function
        functions = {name: resolve(name) for name in names}
    except Exception as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            name, first, kwargs = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe: done
        try:
            if kind == "tool":
                result = functions[name](*first, **kwargs)
                if not isinstance(result, str):
                    raise TypeError(f"tool {name!r} returned {type(result).__name__}, not a string")
                reply = ("ok", result)
            else:
                reply = ("ok", score_values(functions[name], first, kwargs))
        except Exception as err:  # noqa: BLE001 - reported to the parent
            reply = ("error", f"{type(err).__name__}: {err}")
        conn.send(reply)


@contextlib.contextmanager
def _main_module_hidden():
    """spawn re-imports the parent's main script in the child; reward functions are imported by
    name, so skip it (it may be a user script that starts a job, or Ray's worker script)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _stop_process(process, conn) -> None:
    """Kill the child (SIGKILL: a hung function gets no chance to block it) and reap it."""
    try:
        conn.close()
    except OSError:
        pass
    if process.is_alive():
        process.kill()
    process.join(timeout=5)


class RewardSandbox:
    """One child process ("spawn") that runs reward functions by their names, started lazily
    and reused across calls. `call` gives up on a call after `timeout_s`: the child is killed
    and the next call starts a new one. The child is killed when this object is collected or
    the process exits, and exits by itself when its parent dies."""

    def __init__(self, names: Sequence[str], start_timeout_s: float = 120.0, kind: str = "reward"):
        self.names = list(names)
        self.kind = kind  # "reward", or "tool": the functions are tools (operators/environment.py)
        self.start_timeout_s = start_timeout_s
        self.process = None
        self._conn = None
        self._finalizer = None
        self.starts = 0
        # One call at a time on the pipe: Reward may be called from several threads (in a threaded
        # generate actor, reward.placement "generate" with the in-flight engine).
        self._lock = threading.Lock()
        # The child is started from a thread of its own that lives as long as this object: Linux sends the
        # parent-death signal when the *thread* that forked the child exits, and a calling thread may be
        # short-lived (measured: children started from finished threads were SIGKILLed mid-call).
        self._starter = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.is_alive() else None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(
            target=_sandbox_main, args=(child_conn, self.names, os.getpid(), self.kind),
            name=f"streamrl-{self.kind}-sandbox",
        )  # not daemonic, so reward functions may start processes of their own
        with _main_module_hidden():
            process.start()
        child_conn.close()
        # Runs when this object is collected, and at exit before multiprocessing joins its children.
        self._finalizer = multiprocessing.util.Finalize(self, _stop_process, args=(process, conn), exitpriority=10)
        self.process, self._conn = process, conn
        self.starts += 1
        if not conn.poll(self.start_timeout_s):
            self.close()
            raise RuntimeError(f"the reward sandbox process did not start within {self.start_timeout_s:g}s")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            code = process.exitcode
            self.close()
            raise RuntimeError(f"the reward sandbox process died while starting (exit code {code})") from None
        if status != "ready":
            self.close()
            raise RuntimeError(f"the {self.kind} sandbox cannot load the {self.kind} functions {self.names}: {payload}")

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_process once
        self.process = self._conn = self._finalizer = None

    def call(
        self, name: str, completions: list[str], kwargs: dict[str, list], timeout_s: float,
    ) -> tuple[np.ndarray | None, str | None]:
        """(scores with NaN for failed samples, None), or (None, 'timeout'), or (None, what went wrong)
        when the child died or could not answer."""
        with self._lock:
            return self._call(name, completions, kwargs, timeout_s)

    def _call(
        self, name: str, completions: list[str], kwargs: dict[str, list], timeout_s: float,
    ) -> tuple[np.ndarray | None, str | None]:
        if self.process is None or not self.process.is_alive():
            self.close()
            if self._starter is None:
                from concurrent.futures import ThreadPoolExecutor

                self._starter = ThreadPoolExecutor(1, thread_name_prefix="streamrl-reward-sandbox")
            self._starter.submit(self._start).result()
        try:
            self._conn.send((name, completions, kwargs))
        except (OSError, ValueError) as err:  # BrokenPipeError: the child died between calls
            self.close()
            return None, f"could not send the call to the sandbox process ({type(err).__name__}: {err})"
        if not self._conn.poll(timeout_s):
            self.close()  # SIGKILL; the next call starts a fresh child
            return None, "timeout"
        try:
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=1)  # reap it, for the exit code
            code = self.process.exitcode
            self.close()
            return None, f"the sandbox process died (exit code {code})"
        if status != "ok":
            return None, payload
        return payload, None


class Reward:
    """Callable class for `Dataset.map_batches`: adds `rewards` (list of n floats per row).

    Also adds `reward_errors` (samples that fell back to `on_error`), `reward_timeouts` (samples
    whose function call ran over `timeout_s`; they count in `reward_errors` too), one list
    column `reward_<name>` per function, and `time_reward` (seconds of this call per row). With
    `timestamps=True`, also the call's wall-clock interval `reward_start`, `reward_end` (the RL
    pipeline's, from which benchmarks/loop_latency.py measures the hops between stages).

    `timeout_s` > 0 runs the functions in a sandbox child process (see `RewardSandbox`),
    started on the first call and reused: a call (one function, the whole batch) that does not
    answer within `timeout_s` has its child killed and replaced, and that function's samples
    of the batch get `on_error` (no sample-by-sample retry, which could cost n x timeout).
    The child imports the functions by name, so each must be importable ('module:function' on
    the path, or a builtin); config validation checks that. `timeout_s=0` runs them in this
    process with no limit. A function that raises is retried sample by sample either way.
    """

    def __init__(
        self, functions: Sequence[tuple[str, float]] = (("arithmetic_exact", 1.0),), on_error: float = 0.0,
        timeout_s: float = 0.0, timestamps: bool = False,
    ):
        self.timestamps = timestamps
        self.functions = [(name, float(weight), resolve_reward_function(name)) for name, weight in functions]
        self.on_error = float(on_error)
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0: no limit), got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.sandbox = RewardSandbox([name for name, _, _ in self.functions]) if self.timeout_s > 0 else None

    def close(self) -> None:
        """Stop the sandbox process now (it is also stopped when this object is collected)."""
        if self.sandbox is not None:
            self.sandbox.close()

    def _score(self, name: str, fn: RewardFn, completions: list[str], columns: dict[str, list]):
        """Scores, a failure mask, and whether the call timed out."""
        kwargs = _call_kwargs(fn, columns)
        timed_out = False
        if self.sandbox is None:
            scores = score_values(fn, completions, kwargs)
        else:
            scores, problem = self.sandbox.call(name, completions, kwargs, self.timeout_s)
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
        failed = ~np.isfinite(scores)
        scores = np.where(failed, self.on_error, scores)
        return scores, failed, timed_out

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        wall_start = time.time()
        start = time.perf_counter()
        batch = batch.copy()
        if batch.empty:
            for column in ("rewards", "reward_errors", "reward_timeouts", "time_reward"):
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
        timeouts = np.zeros(len(completions), dtype=bool)
        splits = np.cumsum(sizes)[:-1]
        for name, weight, fn in self.functions:
            scores, failed, timed_out = self._score(name, fn, completions, columns)
            total += weight * scores
            errors |= failed
            timeouts |= timed_out
            batch[f"reward_{name.replace(':', '.')}"] = [part.tolist() for part in np.split(scores, splits)]
        if "env_rewards" in batch.columns:  # multi-turn episodes: the environment's rewards count too
            total += np.array([float(value) for values in batch["env_rewards"] for value in values])
        batch["rewards"] = [part.tolist() for part in np.split(total, splits)]
        batch["reward_errors"] = [int(part.sum()) for part in np.split(errors, splits)]
        batch["reward_timeouts"] = [int(part.sum()) for part in np.split(timeouts, splits)]
        batch["time_reward"] = (time.perf_counter() - start) / max(len(batch), 1)
        if self.timestamps:
            batch["reward_start"], batch["reward_end"] = wall_start, time.time()
        return batch
