"""Reward functions written for TRL's GRPOTrainer run unchanged (issue 47, item 1): the Reward stage hands them
`prompts`, `completions` (messages for conversational prompts), `completion_ids` and the dataset's columns by
keyword, awaits `async def` ones, reads None as "does not apply", and the check of a job's inputs reads their
signatures the same way. The functions are tests/trl_style_rewards.py, written in TRL's style for these tests."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from operators.stages.reward import Reward
from operators.stages.reward_calls import call_problem, reward_style, style_columns

import trl_style_rewards as trl


def text_batch() -> pd.DataFrame:
    """Two groups as the Reward stage gets them: the prompt as text, the responses and their token ids."""
    return pd.DataFrame({
        "prompt_id": ["p0", "p1"], "prompt": ["What is 1+1?", "What is 2+5? Be brief."], "answer": ["2", "7"],
        "responses": [["2 is it", "3"], ["7", " 7.", "x"]],
        "response_token_ids": [[np.array([5, 6, 7]), np.array([8])], [np.array([9]), np.array([1, 2]), np.array([3])]],
    })


def chat_batch() -> pd.DataFrame:
    """The same with prompts as lists of messages (as Ray Data hands them over: arrays of dicts)."""
    batch = text_batch()
    batch["prompt"] = [np.array([{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}],
                                dtype=object) for p in ("What is 1+1?", "What is 2+5?")]
    return batch


def name(fn) -> str:
    return f"trl_style_rewards:{fn.__name__}"


def test_a_trl_style_function_gets_prompts_completions_ids_and_columns_aligned():
    out = Reward([(name(trl.leading_number_is_answer), 1.0), (name(trl.prompt_length), 0.0),
                  (name(trl.token_count), 0.0)])(text_batch())
    assert out["rewards"].tolist() == [[1.0, 0.0], [1.0, 1.0, 0.0]]
    assert out["reward_errors"].tolist() == [0, 0]
    # every completion was handed its own group's prompt, and the ids it was sampled as
    assert out["reward_trl_style_rewards.prompt_length"].tolist() == [[12.0, 12.0], [22.0, 22.0, 22.0]]
    assert out["reward_trl_style_rewards.token_count"].tolist() == [[3.0, 1.0], [1.0, 2.0, 1.0]]


def test_conversational_prompts_give_messages_and_completions_as_assistant_messages():
    out = Reward([(name(trl.said_in_conversation), 1.0)])(chat_batch())
    assert out["rewards"].tolist() == [[1.0, 0.0], [1.0, 1.0, 0.0]]
    assert json.loads(out["reward_raised"].iloc[0]) == {}
    # the prompt a trl-style function sees is the messages' text, system message included
    lengths = Reward([(name(trl.prompt_length), 1.0)])(chat_batch())["rewards"].tolist()
    assert lengths == [[21.0, 21.0], [21.0, 21.0, 21.0]]


def test_none_means_does_not_apply_for_trl_style_and_could_not_score_for_streamrl_style():
    out = Reward([(name(trl.only_for_even_answers), 1.0), (name(trl.leading_number_is_answer), 1.0)],
                 on_error=-5.0)(text_batch())
    # answer 2 is even: 10 + the match; answer 7 is odd: the other function's score alone, and no error
    assert out["rewards"].tolist() == [[11.0, 10.0], [1.0, 1.0, 0.0]]
    assert out["reward_errors"].tolist() == [0, 0]
    streamrl = Reward([("reward_fixtures:none_for_empty", 1.0)], on_error=-5.0)(
        pd.DataFrame({"prompt": ["q"], "answer": ["1"], "responses": [["1", ""]]}))
    assert streamrl["rewards"].tolist() == [[1.0, -5.0]] and streamrl["reward_errors"].tolist() == [1]


def test_async_functions_are_awaited_also_where_an_event_loop_runs():
    import asyncio

    expected = [[1.0, 0.0], [1.0, 1.0, 0.0]]
    assert Reward([(name(trl.judged_later), 1.0)])(text_batch())["rewards"].tolist() == expected

    async def inside_a_loop():  # the generate actor scores in a thread of its own; a loop may run in it
        return Reward([(name(trl.judged_later), 1.0)])(text_batch())["rewards"].tolist()

    assert asyncio.run(inside_a_loop()) == expected


def test_the_style_is_read_from_the_signature_or_named():
    assert reward_style(trl.leading_number_is_answer) == "trl"  # takes prompts
    assert reward_style(trl.token_count) == "trl"  # takes completion_ids
    assert reward_style(trl.length_of_whatever_it_gets) == "streamrl"  # (completions, **kwargs): either could be
    assert reward_style(trl.length_of_whatever_it_gets, "trl") == "trl"
    with pytest.raises(ValueError, match="one of"):
        reward_style(trl.token_count, "openai")
    # written for conversational TRL data, it reads messages: auto hands it text, and it raises on every sample,
    # which the stage names; the config's style: trl makes it work
    wrong = Reward([(name(trl.length_of_whatever_it_gets), 1.0)])(chat_batch())
    assert "TypeError" in json.loads(wrong["reward_raised"].iloc[0])[name(trl.length_of_whatever_it_gets)]
    right = Reward([(name(trl.length_of_whatever_it_gets), 1.0, "trl")])(chat_batch())
    assert right["rewards"].tolist() == [[len("2 is it"), 1.0], [1.0, 3.0, 1.0]]


def test_the_input_check_reads_a_trl_signature():
    columns = {"prompt", "answer", "prompt_id", "epoch"}
    for fn in (trl.leading_number_is_answer, trl.prompt_length, trl.token_count, trl.judged_later):
        assert call_problem(fn, style_columns(columns, reward_style(fn)), "data.path 'x'") is None, fn
    problem = call_problem(trl.needs_a_solution_column, style_columns(columns, "trl"), "data.path 'x'")
    assert problem is not None and "['solution']" in problem and "data.path 'x'" in problem
    assert call_problem(trl.needs_a_solution_column, style_columns(columns | {"solution"}, "trl")) is None
    # streamrl style is not offered prompts or completion_ids
    assert "prompts" in call_problem(trl.prompt_length, style_columns(columns, "streamrl"))


@pytest.mark.parametrize("functions", [
    [(name(trl.leading_number_is_answer), 1.0), (name(trl.only_for_even_answers), 0.5)],
    [(name(trl.said_in_conversation), 1.0), (name(trl.judged_later), 2.0)],
    [(name(trl.length_of_whatever_it_gets), 1.0)],  # raises on every sample: named the same in both
])
def test_the_sandbox_child_scores_trl_style_functions_as_the_stage_does(functions):
    batch = chat_batch() if functions[0][0].endswith("conversation") else text_batch()
    in_process = Reward(functions, on_error=-1.0)(batch)
    sandboxed = Reward(functions, on_error=-1.0, timeout_s=20)
    try:
        out = sandboxed(batch)
    finally:
        sandboxed.close()
    pd.testing.assert_frame_equal(out.drop(columns="time_reward"), in_process.drop(columns="time_reward"))
