"""The format a completion states its final answer in, and scoring that answer with reasoning-gym's own scorer.

One declared format (`ANSWER_FORMAT`) and the system prompt that asks for it (`SYSTEM_PROMPT`) are defined
here and nowhere else: configs quote `SYSTEM_PROMPT` as `data.system_prompt`, the builtin rewards
`reasoning_gym` and `answer_format` (operators/stages/reward.py) read answers with `extract_answer`.
benchmarks/task_base_rates.py measured the formats of `ANSWER_FORMATS` on SmolLM2-135M-Instruct
(benchmarks/results/task_base_rates.json): asked by the system prompt, it states an answer in <answer> tags or on
an 'Answer:' line almost never (0-1% of samples, at temperature 1 and 0.7), but ends with 'The answer is N.' in
25-55% of them, so that sentence is the declared format.

reasoning-gym is imported only when a reasoning_gym score is asked for (the reward sandbox starts without it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional


@dataclass(frozen=True)
class AnswerFormat:
    name: str
    pattern: re.Pattern  # group 1 is the answer; the last match in a completion counts
    system_prompt: str  # asks for this format
    example: str  # the format around the answer 42


ANSWER_FORMATS = {
    # <answer>...</answer>, reasoning-gym's own convention (reasoning_gym.utils.extract_answer): the last
    # complete pair of tags counts; an opening tag without its closing tag is no answer.
    "tag": AnswerFormat(
        "tag", re.compile(r"<answer>(.*?)</answer>", re.DOTALL),
        "Solve the problem. Think step by step, briefly. Then give only the final answer between "
        "<answer> and </answer> tags, for example <answer>42</answer>.",
        "<answer>42</answer>",
    ),
    # A line that starts with 'Answer:' (case and surrounding markdown '**' ignored): the last such line counts.
    "line": AnswerFormat(
        "line", re.compile(r"^[ \t*#]*answer[ \t*]*:[ \t*]*(.*?)[ \t*]*$", re.IGNORECASE | re.MULTILINE),
        "Solve the problem. Think step by step, briefly. Then write the final answer on the last line as "
        "'Answer: ' followed by only the answer, for example: Answer: 42",
        "Answer: 42",
    ),
    # A sentence 'The answer is N.': the text after the last 'answer is' (any case; ':', '**' and '$' around it
    # ignored) up to the end of its sentence or line. SmolLM2-135M-Instruct ends many responses this way unasked.
    "sentence": AnswerFormat(
        "sentence", re.compile(r"\banswer is\b[ \t:*$]*([^\n]*?)[ \t*$]*(?:\.(?=\s|$)|\n|$)", re.IGNORECASE),
        "Solve the problem. Think step by step, briefly. End with the sentence 'The answer is N.' where N is the "
        "final answer.",
        "The answer is 42.",
    ),
}
ANSWER_FORMAT = "sentence"  # the declared format
SYSTEM_PROMPT = ANSWER_FORMATS[ANSWER_FORMAT].system_prompt  # quoted by configs as data.system_prompt
REASONING_GYM_REQUIREMENT = "reasoning-gym==0.1.25"  # as pinned in pyproject.toml


def extract_answer(completion: str, answer_format: str = ANSWER_FORMAT) -> Optional[str]:
    """The answer the completion states in `answer_format` (the last one when it states several, stripped),
    or None when it states none or an empty one."""
    matches = ANSWER_FORMATS[answer_format].pattern.findall(completion or "")
    answer = matches[-1].strip() if matches else ""
    return answer or None


def format_scores(completions: list[str], answer_format: str = ANSWER_FORMAT) -> list[float]:
    """1.0 per completion that states a non-empty answer in `answer_format`, else 0.0."""
    return [float(extract_answer(text, answer_format) is not None) for text in completions]


# --- reasoning-gym entries travel as JSON; tuples and sets survive the trip (arc tasks' scorers compare them)


def _tagged(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(item) for item in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_tagged(item) for item in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if isinstance(value, dict):
        return {key if isinstance(key, str) else json.dumps(_tagged(key)): _tagged(item)
                for key, item in value.items()}
    return value


def _untagged(record: dict) -> Any:
    if set(record) == {"__tuple__"}:
        return tuple(record["__tuple__"])
    if set(record) == {"__set__"}:
        return set(record["__set__"])
    return record


def entry_to_json(entry: dict) -> str:
    """A reasoning-gym entry ({question, answer, metadata}) as JSON; `entry_from_json` gives it back."""
    return json.dumps(_tagged(entry), default=repr)


def entry_from_json(text: str) -> dict:
    return json.loads(text, object_hook=_untagged)


@lru_cache(maxsize=32)
def task_scorer(task: str, options_json: str = "{}"):
    """The task's dataset object (one per task and options), whose `score_answer(answer, entry)` scores."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(options_json))


def reasoning_gym_scores(
    completions: list[str], rg_task: list[str], rg_entry: list[str], rg_options: Optional[list[str]] = None,
    answer_format: str = ANSWER_FORMAT,
) -> list[float]:
    """The task's own score in [0, 1] of the answer each completion states in `answer_format`; 0.0 when it
    states none. `rg_entry`: the entry as JSON (`entry_to_json`); `rg_options`: the task options as JSON."""
    if not len(completions) == len(rg_task) == len(rg_entry):
        raise ValueError(f"{len(completions)} completions but {len(rg_task)} tasks and {len(rg_entry)} entries")
    options = rg_options if rg_options is not None else ["{}"] * len(completions)
    scores = []
    for text, task, entry, task_options in zip(completions, rg_task, rg_entry, options):
        answer = extract_answer(text, answer_format)
        if answer is None:
            scores.append(0.0)
            continue
        scorer = task_scorer(task, task_options or "{}")
        scores.append(float(scorer.score_answer(answer, entry_from_json(entry))))
    return scores
