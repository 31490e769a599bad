"""How a reward function is called: its style, its arguments read from its signature, `async def`, and what a
None or an exception from it means. The Reward stage (operators/stages/reward.py) and the sandbox child that
runs functions with a time limit (operators/environments/sandbox.py) both call through here.

Two styles, told apart by the signature or named in the config (`reward.functions[i].style`):

* **streamrl** (the builtins): `fn(completions, **columns)`, the completions as text and the dataset's columns
  as keyword lists aligned with them. None for a sample means "could not score it": `reward.on_error`, counted
  in `reward_errors`.
* **trl**, as written for TRL's GRPOTrainer: `fn(prompts=, completions=, completion_ids=, **columns)`. The
  prompts as the dataset holds them (text, or a list of messages), the completions as text, or for a prompt
  that is a list of messages as `[{"role": "assistant", "content": text}]`; the sampled token ids; every
  dataset column but the prompt. None for a sample means "this function does not apply to it": it adds
  nothing to that sample's reward and is no error. (TRL's `trainer_state` is not passed.)

`auto` picks trl for a function that takes an argument named `prompts` or `completion_ids`, else streamrl.
Either style may be `async def`: the call is awaited (on a fresh event loop, in a thread of its own where this
thread already runs one). A parameter named `completions` is filled by keyword, else the first positional one
takes them. A function that raises on the whole batch is retried sample by sample.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

RewardFn = Callable[..., Sequence[float | None]]
STYLES = ("auto", "streamrl", "trl")
TRL_ARGUMENTS = frozenset({"prompts", "completion_ids"})  # what a trl-style function gets besides the columns


def reward_style(fn: RewardFn, style: str = "auto") -> str:
    """'streamrl' or 'trl': the config's word, or for 'auto' the signature's."""
    if style not in STYLES:
        raise ValueError(f"a reward function's style is one of {STYLES}, got {style!r}")
    if style != "auto":
        return style
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "streamrl"
    return "trl" if names & TRL_ARGUMENTS else "streamrl"


def style_columns(columns: Collection[str], style: str) -> set[str]:
    """The keyword arguments a function of `style` may take, given the rows' reward columns."""
    if style == "trl":  # TRL passes the prompt as `prompts`, not under its column's name
        return (set(columns) - {"prompt"}) | TRL_ARGUMENTS
    return set(columns)


def _parameters(fn: RewardFn) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _by_keyword(params: list[inspect.Parameter] | None) -> bool:
    """Whether the completions go in as `completions=` (a parameter of that name takes keywords)."""
    return any(p.name == "completions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params or ())


def call_kwargs(fn: RewardFn, columns: dict[str, list]) -> dict[str, list]:
    """Pass every column to a **kwargs function, else only the ones it names."""
    params = _parameters(fn)
    if params is None:
        return columns
    if _by_keyword(params):
        columns = {key: value for key, value in columns.items() if key != "completions"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params}
    return {key: value for key, value in columns.items() if key in names}


def call_problem(fn: RewardFn, columns: Collection[str], rows: str = "the rows") -> str | None:
    """Why `fn` cannot be called as Reward calls it on `rows` whose columns give these keyword arguments
    (style_columns of the reward columns): read from its signature. None when it can be, or when Python cannot
    read its signature."""
    params = _parameters(fn)
    if params is None:
        return None
    kinds = inspect.Parameter
    if _by_keyword(params):
        taken = next(p for p in params if p.name == "completions")
    else:
        positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        if not positional and not any(p.kind is kinds.VAR_POSITIONAL for p in params):
            return ("takes no argument for the completions; a reward function is fn(completions, **dataset_columns) "
                    "-> list[float], e.g. def score(completions, answer, **kwargs)")
        taken = positional[0] if positional else None
    rest = [p for p in params if p is not taken and p.default is p.empty
            and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    unreachable = [p.name for p in rest if p.kind is kinds.POSITIONAL_ONLY]
    missing = [p.name for p in rest if p.kind is not kinds.POSITIONAL_ONLY and p.name not in columns]
    if not (unreachable or missing):
        return None
    named = unreachable + missing
    return (f"takes {named}, which no column of {rows} gives (it is called with the completions and, by name, "
            f"{sorted(columns)}); rename the argument(s) after those, give them defaults, or add the column(s) to "
            "the dataset")


def _awaited(value):
    """The result of an awaitable (an `async def` function's call), else `value` itself."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case (a Ray Data actor, the sandbox child)
        return asyncio.run(wait())
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="streamrl-async-reward") as pool:  # this thread's loop is busy
        return pool.submit(asyncio.run, wait()).result()


def call(fn: RewardFn, completions: list, kwargs: dict[str, list]) -> list:
    params = _parameters(fn)
    value = fn(completions=completions, **kwargs) if _by_keyword(params) else fn(completions, **kwargs)
    return list(_awaited(value))


def _as_score(value) -> float:
    """A finite float, or NaN for None, non-numbers and infinities."""
    try:
        return float(value) if value is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def score_values(fn: RewardFn, completions: list, kwargs: dict[str, list]) -> tuple[np.ndarray, np.ndarray, str | None]:
    """One score per completion, NaN where the function failed or returned None; which samples it returned None
    for (a mask); and the exception ('Type: message') when it raised on every sample, else None. A failing batch
    call is retried sample by sample, so one bad sample does not cost the others their scores."""
    raised = None
    try:
        values = call(fn, completions, kwargs)
        if len(values) != len(completions):
            raise ValueError(f"returned {len(values)} scores for {len(completions)} completions")
        returned = np.array([value is None for value in values], dtype=bool)
    except Exception:  # noqa: BLE001 - any failure of user code is contained
        values, returned, failures = [], [], 0
        for index, completion in enumerate(completions):
            try:
                value = call(fn, [completion], {k: [v[index]] for k, v in kwargs.items()})[0]
                values.append(value)
                returned.append(value is None)
            except Exception as err:  # noqa: BLE001
                values.append(None)
                returned.append(False)
                failures += 1
                raised = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        raised = raised if completions and failures == len(completions) else None
        returned = np.array(returned, dtype=bool)
    return np.array([_as_score(value) for value in values], dtype=float), returned, raised


def sandbox_scores(fn: RewardFn, completions: list, kwargs: dict[str, list]) -> dict:
    """`score_values` as the sandbox child replies it (operators/environments/sandbox.py): JSON numbers, None for the
    samples that failed or returned None (NaN and infinities are not JSON), the indexes of those that returned
    None, and the exception when it raised on every sample."""
    scores, returned, raised = score_values(fn, completions, kwargs)
    return {"scores": [float(value) if np.isfinite(value) else None for value in scores],
            "none": np.flatnonzero(returned).tolist(), "raised": raised}


def scores_from_reply(value, size: int) -> tuple[np.ndarray, np.ndarray, str | None]:
    """`score_values`' three from a sandbox reply; raises ValueError for anything else."""
    scores = value.get("scores") if isinstance(value, dict) else None
    raised = value.get("raised") if isinstance(value, dict) else None
    nones = value.get("none") if isinstance(value, dict) else None
    if not isinstance(scores, list) or len(scores) != size or not isinstance(raised, (str, type(None))) or \
            not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores) or \
            not isinstance(nones, list) or not all(isinstance(i, int) and 0 <= i < size for i in nones):
        raise ValueError(f"the sandbox's reply is not {size} scores")
    returned = np.zeros(size, dtype=bool)
    returned[nones] = True
    return np.array([np.nan if v is None else v for v in scores], dtype=float), returned, raised


def _messages(prompt) -> list[dict] | None:
    """A prompt that is a list of messages (from Arrow: an array of dicts) as plain dicts, else None."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple, np.ndarray)) or len(prompt) == 0:
        return None
    if not all(isinstance(message, Mapping) and "role" in message for message in prompt):
        return None
    return [{key: (value.tolist() if isinstance(value, np.ndarray) else value) for key, value in message.items()}
            for message in prompt]


def trl_arguments(prompts: Sequence, completions: list[str], completion_ids: Sequence) -> tuple[list, dict[str, list]]:
    """A trl-style function's completions and its `prompts` and `completion_ids`, one per completion (the
    prompts repeated over their group): conversational where the prompt is a list of messages."""
    as_messages = [_messages(prompt) for prompt in prompts]
    shown = [messages if messages is not None else prompt for messages, prompt in zip(as_messages, prompts)]
    first = [[{"role": "assistant", "content": text}] if messages is not None else text
             for messages, text in zip(as_messages, completions)]
    ids = [[int(token) for token in each] for each in completion_ids]
    return first, {"prompts": shown, "completion_ids": ids}
