"""Advantage estimators, the Advantage operator and Registry, against hand-computed values."""

import numpy as np
import pandas as pd
import pytest

from operators.stages.advantage import Advantage
from operators.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    STEP_WHITENED,
    dr_grpo,
    grpo,
    grpo_no_std,
    overlong_shaping,
    reinforce_pp_baseline,
    rloo,
    whiten_over_step,
)
from operators.algorithms.registry import Registry

ATOL = 1e-6


# ---------------------------------------------------------------- estimators


def test_grpo_binary_rewards_default_eps():
    # mean 0.5, deviations +-0.5, sum of squares 4*0.25 = 1,
    # unbiased var 1/3, std sqrt(1/3) = 0.5773502692
    # adv = +-0.5 / (0.5773502692 + 1e-6) = +-0.8660239...
    adv = grpo(np.array([[1.0, 0.0, 0.0, 1.0]]))
    np.testing.assert_allclose(adv, [[0.866024, -0.866024, -0.866024, 0.866024]], atol=ATOL)
    assert adv.dtype == np.float64


def test_grpo_multiple_groups_and_identical_rewards_give_zero():
    # group 0: [1,2,3,4], mean 2.5, deviations [-1.5,-0.5,0.5,1.5],
    #   sum of squares 2.25+0.25+0.25+2.25 = 5, unbiased var 5/3, std 1.2909944487
    #   adv = [-1.5, -0.5, 0.5, 1.5] / 1.2909944487 = [-1.1618950, -0.3872983, 0.3872983, 1.1618950]
    # group 1: identical rewards, std 0 -> 0 / eps = 0 (not NaN)
    # eps=1e-12 keeps group 0 exact while group 1 is still 0 / eps = 0.
    adv = grpo(np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0]]), eps=1e-12)
    expected = [[-1.1618950, -0.3872983, 0.3872983, 1.1618950], [0.0, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(adv, expected, atol=ATOL)


def test_grpo_identical_rewards_default_eps_no_nan():
    adv = grpo(np.array([[0.7, 0.7, 0.7]]))
    assert not np.isnan(adv).any()
    np.testing.assert_allclose(adv, [[0.0, 0.0, 0.0]], atol=ATOL)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_single_response_groups_give_zero(name):
    # n == 1: no other response to compare against -> 0, and no ddof=1 NaN.
    adv = ADVANTAGE_ESTIMATORS.get(name)(np.array([[3.0], [5.0]]))
    np.testing.assert_array_equal(adv, [[0.0], [0.0]])


@pytest.mark.parametrize("fn", [grpo_no_std, dr_grpo])
def test_grpo_no_std_and_dr_grpo_subtract_group_mean(fn):
    # group 0: mean 2.5 -> [1-2.5, 2-2.5, 3-2.5, 4-2.5] = [-1.5, -0.5, 0.5, 1.5]
    # group 1: mean 0.5 -> [-0.5, -0.5, 0.5, 0.5]
    adv = fn(np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0]]))
    np.testing.assert_allclose(adv, [[-1.5, -0.5, 0.5, 1.5], [-0.5, -0.5, 0.5, 0.5]], atol=ATOL)


def test_rloo_leave_one_out_baseline():
    # group 0 [1,2,3,4]:
    #   A0 = 1 - (2+3+4)/3 = 1 - 3   = -2
    #   A1 = 2 - (1+3+4)/3 = 2 - 8/3 = -0.6666667
    #   A2 = 3 - (1+2+4)/3 = 3 - 7/3 =  0.6666667
    #   A3 = 4 - (1+2+3)/3 = 4 - 2   =  2
    # group 1 [1,0,0,1]:
    #   A(r=1) = 1 - (0+0+1)/3 =  0.6666667
    #   A(r=0) = 0 - (1+0+1)/3 = -0.6666667
    adv = rloo(np.array([[1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 0.0, 1.0]]))
    expected = [
        [-2.0, -0.6666667, 0.6666667, 2.0],
        [0.6666667, -0.6666667, -0.6666667, 0.6666667],
    ]
    np.testing.assert_allclose(adv, expected, atol=ATOL)


def test_reinforce_pp_baseline_group_part_then_whole_step_whitening():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # group means: [1,0,0,1] -> 0.5, [1,1,1,0] -> 0.75
    # centered: [0.5,-0.5,-0.5,0.5], [0.25,0.25,0.25,-0.75]
    centered = reinforce_pp_baseline(rewards)
    np.testing.assert_allclose(centered, [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]], atol=ATOL)
    assert "reinforce_pp_baseline" in STEP_WHITENED
    # step mean of all 8 = 0; population var = (4*0.25 + 3*0.0625 + 0.5625) / 8 = 1.75 / 8 = 0.21875
    # std = sqrt(0.21875) = 0.4677071733
    #   0.5 / 0.4677071733 = 1.0690450,  0.25 / ... = 0.5345225,  -0.75 / ... = -1.6035675
    adv = whiten_over_step(centered.tolist(), eps=0.0)
    expected = [
        [1.0690450, -1.0690450, -1.0690450, 1.0690450],
        [0.5345225, 0.5345225, 0.5345225, -1.6035675],
    ]
    np.testing.assert_allclose(adv, expected, atol=ATOL)
    assert all(type(v) is float for group in adv for v in group)


def test_whiten_over_step_accepts_per_token_advantages():
    # values 1, 3 (one response each) and [2, 2] (one per token of a third response): mean 2,
    # population std sqrt((1 + 1 + 0 + 0) / 4) = 0.7071068 -> 1 -> -1.4142136, 3 -> 1.4142136, 2 -> 0
    adv = whiten_over_step([[1.0, 3.0], [[2.0, 2.0]]], eps=0.0)
    np.testing.assert_allclose(adv[0], [-1.4142136, 1.4142136], atol=ATOL)
    np.testing.assert_allclose(adv[1][0], [0.0, 0.0], atol=ATOL)


def test_reinforce_pp_advantages_do_not_depend_on_groups_per_call():
    # 8 groups of one step through the Advantage operator in calls of 1 and of 4 groups, then the
    # step's whitening (what Train does): the same advantages. Whitening per call (the old placement)
    # gives different ones, which is the bug this guards against.
    rng = np.random.default_rng(3)
    rewards = rng.integers(0, 2, size=(8, 4)).astype(float)
    rewards[0] = [1.0, 1.0, 1.0, 0.0]  # make sure no call of 4 has all-identical groups only
    op = Advantage("reinforce_pp_baseline")

    def per_step(call_size):
        groups = []
        for start in range(0, 8, call_size):
            batch = pd.DataFrame({"rewards": [list(r) for r in rewards[start:start + call_size]]})
            groups += op(batch)["advantages"].tolist()
        return whiten_over_step(groups)

    np.testing.assert_allclose(per_step(1), per_step(4), atol=1e-12)
    per_call = [whiten_over_step(op(pd.DataFrame({"rewards": [list(r) for r in rewards[s:s + 4]]}))["advantages"]
                                 .tolist()) for s in (0, 4)]
    assert not np.allclose(per_call[0] + per_call[1], per_step(4))


def test_reinforce_pp_baseline_identical_rewards_no_nan():
    adv = whiten_over_step(reinforce_pp_baseline(np.array([[1.0, 1.0], [0.0, 0.0]])).tolist())
    np.testing.assert_array_equal(adv, [[0.0, 0.0], [0.0, 0.0]])


def test_overlong_shaping_dapo():
    # max_new_tokens 4, buffer 2: free up to 4 - 2 = 2 tokens, then -(len - 2) / 2 * penalty
    #   lengths 1, 2 -> 0;  3 -> -0.5;  4 -> -1.0 (penalty 1)  /  -0.25, -0.5 (penalty 0.5)
    np.testing.assert_allclose(overlong_shaping([1, 2, 3, 4], max_new_tokens=4, buffer=2, penalty=1.0),
                               [0.0, 0.0, -0.5, -1.0], atol=ATOL)
    np.testing.assert_allclose(overlong_shaping([1, 2, 3, 4], max_new_tokens=4, buffer=2, penalty=0.5),
                               [0.0, 0.0, -0.25, -0.5], atol=ATOL)
    np.testing.assert_array_equal(overlong_shaping([4, 4], max_new_tokens=4, buffer=0, penalty=1.0), [0.0, 0.0])


def test_advantage_operator_applies_overlong_shaping_before_the_estimator():
    # rewards [1, 1, 0, 0], lengths [1, 4, 3, 2], max 4, buffer 2: shaping [0, -1, -0.5, 0]
    # shaped [1, 0, -0.5, 0], mean 0.125 -> grpo_no_std [0.875, -0.125, -0.625, -0.125]; 2 responses shaped
    batch = pd.DataFrame({"rewards": [[1.0, 1.0, 0.0, 0.0]], "response_lengths": [[1, 4, 3, 2]]})
    out = Advantage("grpo_no_std", max_new_tokens=4, overlong_buffer=2, overlong_penalty=1.0)(batch)
    np.testing.assert_allclose(out["advantages"][0], [0.875, -0.125, -0.625, -0.125], atol=ATOL)
    assert out["overlong_shaped"].tolist() == [2]
    assert out["rewards"][0] == [1.0, 1.0, 0.0, 0.0]  # the task reward is kept for the metrics


def test_estimators_reject_non_2d_rewards():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        grpo(np.array([1.0, 0.0]))


def test_registered_estimator_names():
    assert ADVANTAGE_ESTIMATORS.names() == [
        "dr_grpo",
        "grpo",
        "grpo_no_std",
        "reinforce_pp_baseline",
        "rloo",
    ]
    assert ADVANTAGE_ESTIMATORS.get("dr_grpo") is dr_grpo


# ------------------------------------------------------------------ operator


def test_advantage_operator_adds_columns_and_passes_others_through():
    batch = pd.DataFrame(
        {"prompt": ["a", "b"], "rewards": [[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]},
        index=[10, 20],
    )
    out = Advantage("grpo_no_std")(batch)

    # means 0.5 and 2.0 -> [0.5,-0.5,-0.5,0.5] and zeros
    assert out["advantages"].tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert all(type(v) is float for cell in out["advantages"] for v in cell)
    assert out["prompt"].tolist() == ["a", "b"]
    assert out["rewards"].tolist() == batch["rewards"].tolist()
    assert list(out.index) == [10, 20]
    assert out["time_advantage"].dtype == np.float64
    assert (out["time_advantage"] >= 0).all()
    assert "advantages" not in batch.columns  # input left untouched


def test_advantage_operator_accepts_ndarray_cells_and_eps():
    batch = pd.DataFrame({"rewards": [np.array([1.0, 0.0, 0.0, 1.0])]})
    out = Advantage("grpo", eps=0.0)(batch)
    # +-0.5 / sqrt(1/3) = +-0.8660254
    np.testing.assert_allclose(out["advantages"][0], [0.8660254, -0.8660254, -0.8660254, 0.8660254], atol=ATOL)


def test_advantage_operator_groups_rows_by_n():
    # Rows of different n are processed as separate [g, n] arrays:
    #   n=2 row [1,0] -> grpo_no_std [0.5,-0.5];  n=4 row [3,0,0,3] -> [1.5,-1.5,-1.5,1.5]
    batch = pd.DataFrame({"rewards": [[1.0, 0.0], [3.0, 0.0, 0.0, 3.0]]})
    out = Advantage("grpo_no_std")(batch)
    np.testing.assert_allclose(out["advantages"][0], [0.5, -0.5], atol=ATOL)
    np.testing.assert_allclose(out["advantages"][1], [1.5, -1.5, -1.5, 1.5], atol=ATOL)


def test_advantage_operator_mixed_n_keeps_row_order():
    # rloo per row: [1,0] -> [1-0, 0-1] = [1,-1]
    #               [1,2,3] -> [1-2.5, 2-2, 3-1.5] = [-1.5, 0, 1.5]
    #               [0,1] -> [-1, 1]
    batch = pd.DataFrame({"rewards": [[1.0, 0.0], [1.0, 2.0, 3.0], [0.0, 1.0]]})
    out = Advantage("rloo")(batch)
    np.testing.assert_allclose(out["advantages"][0], [1.0, -1.0], atol=ATOL)
    np.testing.assert_allclose(out["advantages"][1], [-1.5, 0.0, 1.5], atol=ATOL)
    np.testing.assert_allclose(out["advantages"][2], [-1.0, 1.0], atol=ATOL)


def test_advantage_operator_empty_batch():
    batch = pd.DataFrame({"prompt": pd.Series([], dtype=object), "rewards": pd.Series([], dtype=object)})
    out = Advantage()(batch)
    assert len(out) == 0
    assert list(out.columns) == ["prompt", "rewards", "advantages", "overlong_shaped", "time_advantage"]


def test_advantage_operator_unknown_estimator():
    with pytest.raises(KeyError, match="unknown advantage estimator 'foo'; available: dr_grpo, grpo"):
        Advantage("foo")


# ------------------------------------------------------------------ registry


def test_registry_register_get_names_contains():
    reg = Registry("thing")

    @reg.register("b")
    def b():
        return "b"

    @reg.register("a")
    def a():
        return "a"

    assert reg.get("a") is a and reg.get("b") is b
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg


def test_registry_refuses_duplicates():
    reg = Registry("thing")
    reg.register("x")(lambda: 1)
    with pytest.raises(ValueError, match="duplicate thing name 'x'"):
        reg.register("x")(lambda: 2)
    assert reg.get("x")() == 1  # the first registration is kept


def test_registry_keyerror_lists_available_names():
    reg = Registry("thing")
    reg.register("beta")(object())
    reg.register("alpha")(object())
    with pytest.raises(KeyError) as excinfo:
        reg.get("gamma")
    message = excinfo.value.args[0]
    assert "unknown thing 'gamma'; available: alpha, beta" in message
    assert "register" in message  # says how to fix it
