"""A reward function that raises on every sample (a judge that cannot be reached, a signature the job does not
call it with) is named with its exception by the Reward stage, and the Train stage stops the job after
reward.stop_after_failed_steps such steps in a row instead of training on on_error alone."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from operators.stages.reward import FailedRewardSteps, Reward, RewardFunctionError
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config

ALWAYS = "reward_fixtures:always_raises"  # tests/ is on the path (tests/conftest.py)


def groups(responses: list[list[str]], answers: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"prompt_id": [f"p{i}" for i in range(len(answers))], "prompt": ["x"] * len(answers),
                         "answer": answers, "responses": responses})


def test_the_reward_stage_names_a_function_that_raised_on_every_sample():
    out = Reward([(ALWAYS, 1.0), ("arithmetic_exact", 1.0), ("reward_fixtures:flaky_length", 0.0)],
                 on_error=-1.0)(groups([["3", "7"], ["5", "4"]], ["3", "5"]))
    raised = [json.loads(text) for text in out["reward_raised"]]
    # flaky_length raises only on the samples with a '7': it scored the others, so it is not named
    assert raised == [{ALWAYS: "ConnectionError: the judge at http://127.0.0.1:9 refused the connection"}] * 2
    assert out["rewards"].tolist() == [[0.0, -1.0], [0.0, -1.0]]  # on_error + arithmetic_exact
    assert out["reward_errors"].tolist() == [2, 2]
    fine = Reward([("arithmetic_exact", 1.0)])(groups([["3"]], ["3"]))
    assert fine["reward_raised"].tolist() == ["{}"]


def step_rows(*raised: dict) -> list[dict]:
    return [{"group_uid": f"g{i}", "reward_raised": json.dumps(each)} for i, each in enumerate(raised)]


def test_the_job_stops_at_the_first_step_a_function_raised_on_every_sample():
    failing = {ALWAYS: "ConnectionError: refused"}
    with pytest.raises(RewardFunctionError) as info:
        FailedRewardSteps().check(0, step_rows(failing, failing))
    message = str(info.value)
    assert f"reward function '{ALWAYS}' raised on every sample of step 1 (ConnectionError: refused)" in message
    assert "reward.stop_after_failed_steps" in message
    # one group of the step scored: not every sample of the step failed
    FailedRewardSteps().check(0, step_rows(failing, {}))


def test_with_more_steps_allowed_it_warns_until_that_many_in_a_row(capsys):
    failing = {ALWAYS: "ConnectionError: refused"}
    watch = FailedRewardSteps(stop_after=3)
    watch.check(0, step_rows(failing))
    watch.check(1, step_rows(failing))
    warned = capsys.readouterr().err
    assert "WARNING reward function 'reward_fixtures:always_raises' raised on every sample of step 2 and the 1 " \
           "step(s) before it" in warned and "stops at 3 such steps in a row" in warned
    watch.check(2, step_rows({}))  # a step it scored: the count starts again
    watch.check(3, step_rows(failing))
    watch.check(4, step_rows(failing))
    with pytest.raises(RewardFunctionError, match=r"step 6 and the 2 step\(s\) before it"):
        watch.check(5, step_rows(failing))


def test_the_number_of_steps_is_a_validated_field():
    assert load_config(None).reward.stop_after_failed_steps == 1
    assert load_config(None, ["reward.stop_after_failed_steps=4"]).reward.stop_after_failed_steps == 4
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.stop_after_failed_steps=0"])
    assert "greater than or equal to 1" in dict(info.value.problems)["reward.stop_after_failed_steps"]
