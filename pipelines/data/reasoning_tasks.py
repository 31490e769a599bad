"""`data.path: reasoning_gym:<task>`: prompts from a reasoning-gym procedural task, with held-out problems that
training never sees.

reasoning-gym (`pip install reasoning-gym==0.1.25`) makes problems of ~100 tasks (`leg_counting`, `chain_sum`,
`basic_arithmetic`, ...) from a seed; each entry is {question, answer, metadata} and the task scores an answer
itself (`score_answer`). The table has the columns

- `prompt`: chat messages, `[{"role": "user", "content": question}]` (the answer format is asked for by
  `data.system_prompt`, e.g. operators.common.task_answers.SYSTEM_PROMPT);
- `prompt_id`: `<task>-<16 hex digits of sha256(task, question)>`, the same for the same problem in any call;
- `answer`, `rg_task`, `rg_entry` (the entry as JSON) and `rg_options` (the task options as JSON): what the
  `reasoning_gym` reward needs to score with the task's own scorer.

**Splits.** Each problem belongs to one split by the hash of its task and question text: `heldout` when the
hash falls in the lowest `HELDOUT_PERCENT` percent, else `train`. A split's problems are drawn in the task's
own order (entry 0, 1, ... of `create_dataset(task, seed=data.seed)`), those of the other split and repeats
skipped, until `data.num_prompts` distinct problems are found, so the two splits never share a problem,
whatever `num_prompts`, seeds and task options (the same question under other options is the same problem).
`all` takes distinct problems of both. A task whose options admit fewer distinct problems than asked for is
an error that says how many it found.

reasoning-gym seeds each entry with `seed + index`, so `data.seed: 1` gives the problems of seed 0 shifted by
one: change the seed by more than `num_prompts` for another sample of problems.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pandas as pd

from operators.common.task_answers import REASONING_GYM_REQUIREMENT, entry_to_json

REASONING_GYM_PREFIX = "reasoning_gym:"
HELDOUT_PERCENT = 20  # share of every task's problems in the held-out split
INSTALL_HINT = f"install it: pip install {REASONING_GYM_REQUIREMENT}"
CHUNK = 1000  # entries made per dataset object


class TaskError(ValueError):
    """A reasoning_gym dataset cannot be made; `problems` holds (field, message with the fix) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{field}: {message}" for field, message in problems))


def is_reasoning_gym(path: str) -> bool:
    return path.startswith(REASONING_GYM_PREFIX)


def task_name(path: str) -> str:
    return path[len(REASONING_GYM_PREFIX):]


def reasoning_gym_module():
    """The reasoning_gym package, or None when it is not installed (tests patch this to simulate that)."""
    try:
        import reasoning_gym
    except ImportError:
        return None
    return reasoning_gym


def task_problems(path: str, task_options: dict[str, Any], where: str = "data") -> list[tuple[str, str]]:
    """What makes `reasoning_gym:<task>` with these options unusable, as (field, message with the fix): the
    package missing, an unknown task, options the task does not take or values it refuses."""
    rg = reasoning_gym_module()
    if rg is None:
        return [(f"{where}.path", f"{path!r} needs the reasoning-gym package, which is not installed; {INSTALL_HINT}")]
    from reasoning_gym.factory import DATASETS

    task = task_name(path)
    if task not in DATASETS:
        return [(f"{where}.path", f"unknown reasoning_gym task {task!r}; the tasks are: {', '.join(sorted(DATASETS))}")]
    _, config_cls = DATASETS[task]
    accepted = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
    unknown = sorted(set(task_options) - set(accepted))
    if unknown:
        return [(f"{where}.task_options", f"task {task!r} does not take {unknown}; its options are {accepted} "
                 "(data.num_prompts and data.seed give the size and seed)")]
    try:
        rg.create_dataset(task, size=1, seed=0, **task_options)
    except Exception as err:  # noqa: BLE001 - tasks validate with asserts and ValueErrors alike
        return [(f"{where}.task_options", f"task {task!r} refuses the options {task_options}: "
                 f"{type(err).__name__}: {err or 'invalid values'}; fix the values (its options are {accepted})")]
    return []


def problem_hash(task: str, question: str) -> str:
    return hashlib.sha256(f"{task}\n{question}".encode()).hexdigest()


def split_of(digest: str) -> str:
    """'heldout' or 'train': a problem's split, from its hash."""
    return "heldout" if int(digest[:8], 16) % 100 < HELDOUT_PERCENT else "train"


def make_task_dataset(
    task: str, num_prompts: int, seed: int = 0, split: str = "train", task_options: dict[str, Any] | None = None,
    max_misses: int | None = None,
) -> pd.DataFrame:
    """`num_prompts` distinct problems of the task's `split` (train, heldout or all), in the task's order.

    Raises TaskError when the task lacks (or refuses) them. `max_misses`: draws in a row that bring no new
    problem of the split before giving up (default max(2000, 5 x num_prompts))."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split {split!r}: use train, heldout or all")
    options = dict(task_options or {})
    problems = task_problems(REASONING_GYM_PREFIX + task, options)
    if problems:
        raise TaskError(problems)
    import reasoning_gym

    max_misses = max_misses if max_misses is not None else max(2000, 5 * num_prompts)
    options_json = json.dumps(options, sort_keys=True)
    rows: list[dict] = []
    seen: set[str] = set()
    misses = draws = 0
    while len(rows) < num_prompts and misses < max_misses:
        # Entry i of a chunk made with seed + start is entry start + i of one made with seed (reasoning-gym
        # seeds each entry with seed + index), so chunks continue the task's own order.
        dataset = reasoning_gym.create_dataset(task, size=CHUNK, seed=seed + draws, **options)
        for index in range(CHUNK):
            entry = dataset[index]
            draws += 1
            question = entry["question"]
            digest = problem_hash(task, question)
            if question in seen or split != "all" and split_of(digest) != split:
                misses += 1
                if misses >= max_misses:
                    break
                continue
            misses = 0
            seen.add(question)
            rows.append({
                "prompt": [{"role": "user", "content": question}],
                "prompt_id": f"{task}-{digest[:16]}",
                "answer": str(entry["answer"]),
                "rg_task": task,
                "rg_entry": entry_to_json(entry),
                "rg_options": options_json,
            })
            if len(rows) == num_prompts:
                break
    if len(rows) < num_prompts:
        raise TaskError([("data.num_prompts", (
            f"task {task!r} with options {options} gave only {len(rows)} distinct {split} problems in {draws} "
            f"draws (the last {misses} brought none new), fewer than the {num_prompts} asked for; lower "
            f"num_prompts to at most {len(rows)} or widen the task's options (more terms, digits, items)"))])
    return pd.DataFrame(rows)
