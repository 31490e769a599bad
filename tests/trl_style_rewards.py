"""Reward functions written the way TRL's GRPOTrainer calls them (keyword arguments `prompts`, `completions`,
`completion_ids` and the dataset's columns; messages for conversational data; None for "not applicable").
Importable as 'trl_style_rewards:NAME' from tests/ (tests/conftest.py puts tests/ on the path)."""

from __future__ import annotations

import asyncio
import re


def _text(completion) -> str:
    """A completion as TRL hands it: text, or a list of messages whose last is the assistant's."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def leading_number_is_answer(prompts, completions, completion_ids, answer, **kwargs):
    """1.0 when the completion starts with the answer; checks that everything TRL passes is there and aligned."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in completion_ids)
    found = [re.match(r"\s*(-?\d+)", _text(c)) for c in completions]
    return [float(m is not None and m.group(1) == str(a).strip()) for m, a in zip(found, answer)]


def prompt_length(prompts, completions, **kwargs):
    """The length of the prompt each completion answers (shows which prompt a function was handed)."""
    return [float(len(p) if isinstance(p, str) else sum(len(m["content"]) for m in p)) for p in prompts]


def token_count(completions, completion_ids, **kwargs):
    """How many tokens were sampled (from the ids, not from the text)."""
    return [float(len(ids)) for ids in completion_ids]


def said_in_conversation(prompts, completions, answer, **kwargs):
    """Conversational data: each prompt is the user's messages, each completion one assistant message."""
    for prompt, completion in zip(prompts, completions):
        assert isinstance(prompt, list) and prompt[-1]["role"] == "user", prompt
        assert isinstance(completion, list) and completion[0]["role"] == "assistant", completion
    return [float(str(a) in c[0]["content"]) for c, a in zip(completions, answer)]


def only_for_even_answers(prompts, completions, answer, **kwargs):
    """None ("does not apply") where the answer is odd; 10.0 where it is even."""
    return [10.0 if int(a) % 2 == 0 else None for a in answer]


async def judged_later(prompts, completions, answer, **kwargs):
    """An async judge: waits a moment, as a call to a remote grader would, then scores like the first one."""
    await asyncio.sleep(0.01)
    return [float(_text(c).strip().startswith(str(a))) for c, a in zip(completions, answer)]


def length_of_whatever_it_gets(completions, **kwargs):
    """Written for TRL with conversational data in mind: reads the message's content; on text it raises."""
    return [float(len(c[0]["content"])) for c in completions]


def needs_a_solution_column(prompts, completions, solution, **kwargs):
    """Takes a dataset column `solution` (TRL passes every column by name)."""
    return [float(_text(c).strip() == s) for c, s in zip(completions, solution)]


def verl_row_seen(prompts, completions, completion_ids, ground_truth, data_source, **kwargs):
    """1.0 for a sample handed what a row of verl's parquet layout holds (data.columns made `ground_truth` from
    `reward_model.ground_truth`): the prompt as messages, the completion as an assistant message, its token ids,
    the ground truth as text and the data source; 0.0 where anything is missing."""
    return [float(isinstance(p, list) and p[-1]["role"] == "user" and c[0]["role"] == "assistant"
                  and len(ids) > 0 and isinstance(g, str) and g.isdigit() and s == "sums_in_verl_layout")
            for p, c, ids, g, s in zip(prompts, completions, completion_ids, ground_truth, data_source)]
