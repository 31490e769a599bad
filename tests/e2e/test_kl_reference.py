"""KL to a reference policy: the reward penalty (hand-computed), the Advantage operator applying
it, and end to end with the RefLogprob stage: KL is logged at every step, and a larger
coefficient keeps the policy closer to the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from operators.stages.advantage import Advantage
from operators.algorithms.estimators import grpo, sequence_kl_penalty
from pipelines.config.load import load_config
from pipelines.job import run_job

ROOT = Path(__file__).resolve().parents[2]


def test_sequence_kl_penalty_sums_k1_over_tokens():
    behaviour = [[-0.5, -1.0], [-2.0]]
    reference = [[-1.0, -1.5], [-1.0]]
    # response 0: (-0.5 + 1.0) + (-1.0 + 1.5) = 1.0; response 1: -2.0 + 1.0 = -1.0
    np.testing.assert_allclose(sequence_kl_penalty(behaviour, reference), [1.0, -1.0])
    with pytest.raises(ValueError, match="reference log-prob lists"):
        sequence_kl_penalty(behaviour, reference[:1])


def test_advantage_subtracts_the_kl_penalty_from_the_reward():
    batch = pd.DataFrame({
        "rewards": [[1.0, 0.0, 1.0]],
        "behavior_logprobs": [[[-0.5], [-0.2], [-3.0]]],
        "ref_logprobs": [[[-1.0], [-0.2], [-1.0]]],  # penalties 0.5, 0.0, -2.0
    })
    out = Advantage("grpo", kl_reward_coef=0.5)(batch)
    expected = grpo(np.array([[1.0 - 0.25, 0.0, 1.0 + 1.0]]))[0]
    np.testing.assert_allclose(out["advantages"][0], expected)
    assert out["kl_reward_penalty"][0] == pytest.approx((0.5 + 0.0 - 2.0) / 3)
    assert out["rewards"][0] == [1.0, 0.0, 1.0]  # the task reward is kept as it was
    with pytest.raises(ValueError, match="RefLogprob stage"):
        Advantage("grpo", kl_reward_coef=0.5)(batch.drop(columns="ref_logprobs"))


# make test-extended (CI stays under 45 minutes): the KL penalty's maths stays in CI (the tests above), and the
# reference stage through tests/unit/test_ref_logprob.py.
@pytest.mark.slow
@pytest.mark.extended
def test_kl_to_the_reference_is_logged_and_bounded_by_its_coefficient(ray_cluster, tmp_path):
    def job(**algorithm) -> pd.DataFrame:
        sets = ["reference={}", "train.steps=16", "eval=null", "tracking.enabled=false", f"output_dir={tmp_path}",
                *[f"algorithm.{key}={value}" for key, value in algorithm.items()]]
        return run_job(load_config(ROOT / "configs" / "tiny_grpo.yaml", sets), echo=lambda _: None).metrics

    free = job(kl_coef=0.0)
    held = job(kl_coef=2.0, kl_reward_coef=0.5)
    for metrics in (free, held):
        assert metrics["kl_ref"].notna().all() and (metrics["kl_ref"] >= 0).all()  # k3 is never negative
    assert free["kl_ref"].iloc[0] == pytest.approx(0.0, abs=1e-4)  # the first samples come from the reference
    drift, anchored = free["kl_ref"].tail(5).mean(), held["kl_ref"].tail(5).mean()
    assert anchored < 0.8 * drift, (anchored, drift)
