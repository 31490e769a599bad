"""PPO with a critic, below the job: GAE and return targets against hand-computed values, the
clipped value loss, the Advantage operator's token estimators, the critic's DeepSpeed rank and
the Value operator on the tiny model, and the `critic` config section."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from operators.stages.advantage import Advantage
from operators.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ESTIMATORS,
    estimator_kind,
    gae,
    outcome_token_rewards,
)
from operators.algorithms.losses import VALUE_LOSSES, clipped_value_loss
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from samples import step_samples

ATOL = 1e-9


# ---------------------------------------------------------------- GAE and returns


def test_gae_hand_computed():
    # rewards [0, 0, 1], values [0.5, 0.2, 0.8], gamma 0.9, lambda 0.5 (gamma * lambda = 0.45)
    # next values [0.2, 0.8, 0]
    # deltas: 0 + 0.9*0.2 - 0.5 = -0.32;  0 + 0.9*0.8 - 0.2 = 0.52;  1 + 0 - 0.8 = 0.2
    # A_2 = 0.2;  A_1 = 0.52 + 0.45*0.2 = 0.61;  A_0 = -0.32 + 0.45*0.61 = -0.0455
    # returns = A + V = [0.4545, 0.81, 1.0]
    advantages, returns = gae(outcome_token_rewards(1.0, 3), np.array([0.5, 0.2, 0.8]), gamma=0.9, lam=0.5)
    np.testing.assert_allclose(advantages, [-0.0455, 0.61, 0.2], atol=ATOL)
    np.testing.assert_allclose(returns, [0.4545, 0.81, 1.0], atol=ATOL)
    assert advantages.dtype == returns.dtype == np.float64


def test_gae_lambda_one_is_return_minus_value_and_lambda_zero_the_td_error():
    values = np.array([0.3, -0.1, 0.6, 0.25])
    rewards = outcome_token_rewards(2.0, 4)  # [0, 0, 0, 2]
    # gamma 1, lambda 1: A_t = sum of later rewards - V_t = 2 - V_t; every return target is 2
    advantages, returns = gae(rewards, values, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(advantages, 2.0 - values, atol=ATOL)
    np.testing.assert_allclose(returns, [2.0] * 4, atol=ATOL)
    # gamma 0.5, lambda 1: the return of token t is 2 * 0.5^(3 - t) = [0.25, 0.5, 1, 2]
    _, returns = gae(rewards, values, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(returns, [0.25, 0.5, 1.0, 2.0], atol=ATOL)
    # lambda 0: A_t = r_t + V_{t+1} - V_t = [-0.4, 0.7, -0.35, 1.75]
    advantages, returns = gae(rewards, values, gamma=1.0, lam=0.0)
    np.testing.assert_allclose(advantages, [-0.4, 0.7, -0.35, 1.75], atol=ATOL)
    np.testing.assert_allclose(returns, [-0.1, 0.6, 0.25, 2.0], atol=ATOL)  # the next value, then the reward


def test_gae_edge_cases():
    advantages, returns = gae(outcome_token_rewards(1.0, 0), np.zeros(0))
    assert advantages.shape == returns.shape == (0,)
    np.testing.assert_allclose(outcome_token_rewards(0.5, 3), [0.0, 0.0, 0.5])
    with pytest.raises(ValueError, match="must both be"):
        gae(np.zeros(3), np.zeros(2))


def test_token_estimators_have_their_own_registry_and_kind():
    assert TOKEN_ESTIMATORS.names() == ["gae"] and "gae" not in ADVANTAGE_ESTIMATORS
    assert estimator_kind("gae") == "token" and estimator_kind("grpo") == "outcome"
    with pytest.raises(KeyError, match="unknown advantage estimator 'foo'"):
        estimator_kind("foo")


def test_advantage_operator_dispatches_gae_per_token_and_adds_returns():
    batch = pd.DataFrame({
        "group_uid": ["g0"],
        "rewards": [[1.0, 0.0]],
        "values": [[[0.5, 0.2, 0.8], [0.4]]],  # response 0 has 3 tokens, response 1 one
    })
    out = Advantage("gae", gamma=0.9, gae_lambda=0.5)(batch)
    (adv_0, adv_1), (ret_0, ret_1) = out["advantages"].iloc[0], out["returns"].iloc[0]
    np.testing.assert_allclose(adv_0, [-0.0455, 0.61, 0.2], atol=ATOL)  # test_gae_hand_computed
    np.testing.assert_allclose(ret_0, [0.4545, 0.81, 1.0], atol=ATOL)
    np.testing.assert_allclose(adv_1, [-0.4], atol=ATOL)  # reward 0 on its only token: 0 - 0.4
    np.testing.assert_allclose(ret_1, [0.0], atol=ATOL)
    assert out["group_uid"].tolist() == ["g0"] and out["time_advantage"].iloc[0] >= 0


# ---------------------------------------------------------------- value loss


def test_clipped_value_loss_hand_computed():
    # eps 0.2; V_old [0, 0, 1, 0.5], V [0.5, -0.1, 0.7, 0.3], R [1, 1, 0, 1], last token padded
    # clipped V: [0.2, -0.1, 0.8, 0.3]
    # unclipped (V - R)^2:  [0.25, 1.21, 0.49, 0.49];  clipped: [0.64, 1.21, 0.64, 0.49]
    # max: [0.64, 1.21, 0.64, 0.49 (masked -> 0)];  clipped term larger on tokens 0 and 2 of 3 valid
    # loss = 1/2 max (verl, OpenRLHF): [0.32, 0.605, 0.32, 0]
    values = torch.tensor([[0.5, -0.1, 0.7, 0.3]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.0, 0.5]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = clipped_value_loss(values, old, returns, mask, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.605, 0.32, 0.0]], dtype=torch.float64))
    assert stats["value_clip_fraction"] == pytest.approx(2 / 3, abs=1e-9)
    loss.sum().backward()
    # clipped tokens have no gradient; token 1: d (V - R)^2 / 2 / dV = V - R = -0.1 - 1 = -1.1
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.1, 0.0, 0.0]], dtype=torch.float64))
    assert VALUE_LOSSES.get("clipped") is clipped_value_loss


# ---------------------------------------------------------------- the critic rank and the Value operator


def critic_samples(model_path: str) -> dict:
    """The trainer test's two groups as critic samples: return 1 on every token of a correct answer."""
    from operators.algorithms.step_batch import explode

    rows = step_samples(model_path)
    for row, correct in zip(rows, ([1, 0, 0, 1], [1, 0, 1, 0])):  # "3" is 1+2, "15" is 7+8
        row["returns"] = [[float(c)] * len(r) for c, r in zip(correct, row["response_token_ids"])]
        row["values"] = [[0.0] * len(r) for r in row["response_token_ids"]]
    samples = explode(rows)
    return {key: samples[key] for key in ("prompt_token_ids", "response_token_ids", "returns", "old_values")}


def make_critic(model_path: str, **extra):
    from operators.workers.value_worker import ValueWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import critic_settings

    sets = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1", "algorithm.advantage=gae",
            "critic.lr=0.01", *[f"{k}={v}" for k, v in extra.items()]]
    cfg = load_config(None, sets)
    return ValueWorker(0, 1, free_port(), critic_settings(cfg, model_path), None, cfg.critic.value_clip)


def test_critic_learns_its_targets_and_the_value_operator_reads_the_same_values(tiny_model_path, tmp_path):
    """In-process (no Ray): the critic rank fits the return targets (the loss falls), a checkpoint
    round trip restores it exactly, and the Value operator, loaded from the critic's export, gives
    per response token the values the rank computes (same positions, same shift)."""
    from operators.stages.value import Value

    samples = critic_samples(tiny_model_path)
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["response_token_ids"])
    critic = make_critic(tiny_model_path, **{"critic.value_clip": 10.0, "critic.lr": 0.003})
    losses = [critic.train_step(samples, tokens, count)["value_loss"] for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert critic.version == 10

    critic.save_checkpoint(str(tmp_path / "critic"))
    critic.save_pretrained(str(tmp_path / "export"))
    restored = make_critic(tiny_model_path)
    assert restored.load_checkpoint(str(tmp_path / "critic"), version=10) == 10
    for name, array in restored.state_dict().items():
        np.testing.assert_array_equal(array, critic.state_dict()[name], err_msg=name)

    rows = pd.DataFrame({"prompt_token_ids": [list(samples["prompt_token_ids"][0]), list(samples["prompt_token_ids"][4])],
                         "response_token_ids": [samples["response_token_ids"][:4], samples["response_token_ids"][4:]],
                         "other": ["a", "b"]})
    out = next(iter(Value(str(tmp_path / "export"))(rows)))
    assert out["other"].tolist() == ["a", "b"] and (out["critic_version"] == 0).all()
    flat = [values for row in out["values"] for values in row]
    assert [len(v) for v in flat] == [len(r) for r in samples["response_token_ids"]]
    with torch.no_grad():  # the rank's own forward, one sample at a time (no padding at all)
        for index, values in enumerate(flat):
            batch = critic._batch_tensors({key: [samples[key][index]] for key in samples})
            expected = batch.at_response(critic.values(batch), 0)
            np.testing.assert_allclose(values, expected.numpy(), rtol=1e-4, atol=1e-5)
    # Trained towards the targets: once the answer is written (the value before EOS), correct answers are
    # valued above wrong ones.
    correct = [v[-1] for v, r in zip(flat, samples["returns"]) if r[0] == 1.0]
    wrong = [v[-1] for v, r in zip(flat, samples["returns"]) if r[0] == 0.0]
    assert min(correct) > max(wrong), (correct, wrong)


def test_value_clip_stops_tokens_that_moved_past_it(tiny_model_path):
    """V_old = the critic's own values: the first step clips nothing (V = V_old); it moves the values
    towards their targets by far more than a tiny value_clip, so in the next step the clipped term is
    the larger on most tokens (their gradient is zero)."""
    samples = critic_samples(tiny_model_path)
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["response_token_ids"])
    critic = make_critic(tiny_model_path, **{"critic.value_clip": 1e-3, "critic.lr": 0.003})
    with torch.no_grad():
        batch = critic._batch_tensors(samples)
        values = critic.values(batch)
    samples["old_values"] = [batch.at_response(values, row).tolist() for row in range(count)]
    first, second = (critic.train_step(samples, tokens, count) for _ in range(2))
    assert first["value_clip_fraction"] == 0.0
    assert second["value_clip_fraction"] > 0.5, second


# ---------------------------------------------------------------- config


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return dict(info.value.problems)


def test_critic_config_is_validated_up_front(tmp_path):
    found = problems(["algorithm.advantage=gae"])
    assert list(found) == ["algorithm.advantage"] and "no critic section" in found["algorithm.advantage"]
    found = problems(["critic.lr=0.001"])  # grpo with a critic
    assert list(found) == ["critic"] and "trained for nothing" in found["critic"]
    found = problems(["algorithm.advantage=gae", "algorithm.gamma=1.5", "algorithm.gae_lambda=-0.1",
                      "critic.value_clip=0", "critic.lr=0", f"critic.model_path={tmp_path / 'nope'}"])
    assert set(found) == {"algorithm.gamma", "algorithm.gae_lambda", "critic.value_clip", "critic.lr",
                          "critic.model_path"}
    assert "[0, 1]" in found["algorithm.gamma"] and "clip > 0" in found["critic.value_clip"]
    assert "does not exist" in found["critic.model_path"]
    found = problems(["algorithm.advantage=gae", "critic.world_size=3"])  # 64 samples per step
    assert "do not split evenly over 3" in found["critic.world_size"]
    cfg = load_config(None, ["algorithm.advantage=gae", "critic.lr=0.002"])
    assert cfg.critic.model_path == cfg.model.path and cfg.critic.value_clip == 0.2


def test_critic_resources_are_planned_and_only_they_may_change_on_resume():
    from pipelines.config.load import flatten
    from pipelines.runtime.resources import demands
    from pipelines.recovery.resume import config_changes

    cfg = load_config(None, ["algorithm.advantage=gae", "critic.world_size=2", "critic.num_cpus=0.5"])
    plan = demands(cfg)
    assert plan["critic"].count == 2 and plan["critic"].resources["CPU"] == 0.5 and "value" in plan
    saved = flatten(cfg)
    moved = load_config(None, ["algorithm.advantage=gae", "critic.world_size=2", "critic.num_cpus=0.25",
                               "critic.torch_threads=2"])
    assert config_changes(saved, moved) == []
    relearned = load_config(None, ["algorithm.advantage=gae", "critic.world_size=2", "critic.num_cpus=0.5",
                                   "critic.lr=0.01", "algorithm.gae_lambda=0.9"])
    assert [key for key, _ in config_changes(saved, relearned)] == ["algorithm.gae_lambda", "critic.lr"]


def test_packed_critic_step_and_value_stage_equal_the_padded_ones(tiny_model_path):
    """train.packing and train.share_prompts reach the critic: its step (value loss, gradient norm, weights) and
    the Value stage's values are the padded ones', computed on packed rows and on rows with each group's
    prompt once."""
    from operators.stages.value import Value

    samples = critic_samples(tiny_model_path)
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["response_token_ids"])
    layouts = {"padded": {"train.packing": "false"}, "packed": {}, "shared": {"train.share_prompts": "true"}}
    steps = {}
    for name, sets in layouts.items():
        critic = make_critic(tiny_model_path, **{**sets, "train.micro_batch_tokens": 20})
        assert critic.settings.packing is (name != "padded") and (critic._shared_mask is not None) is (name == "shared")
        steps[name] = (critic.train_step(samples, tokens, count), critic.state_dict())
    padded, padded_weights = steps["padded"]
    for name in ("packed", "shared"):
        step, weights = steps[name]
        np.testing.assert_allclose(step["value_loss"], padded["value_loss"], rtol=1e-5)
        np.testing.assert_allclose(step["grad_norm"], padded["grad_norm"], rtol=1e-5)
        for key in padded_weights:  # Adam's first step is ~lr * sign(g): a near-zero gradient may flip (see
            # test_trainer_device._assert_same_step); a misweighted or lost token would move many elements by ~2 lr
            diff = np.abs(np.asarray(weights[key], dtype=np.float64) - np.asarray(padded_weights[key], dtype=np.float64))
            assert diff.max() <= 0.01 and (diff > 1e-5).mean() <= 1e-3, (name, key, float(diff.max()))

    rows = pd.DataFrame({"prompt_token_ids": [list(samples["prompt_token_ids"][0]), list(samples["prompt_token_ids"][4])],
                         "response_token_ids": [samples["response_token_ids"][:4], samples["response_token_ids"][4:]]})
    values = {}
    for name, packing, share in (("padded", False, False), ("packed", True, False), ("shared", True, True)):
        torch.manual_seed(0)  # the folder has no value head: the same freshly initialised one for each
        stage = Value(tiny_model_path, packing=packing, share_prompts=share)
        assert (stage.shared_mask is not None) is share
        values[name] = next(iter(stage(rows)))["values"]
    for name in ("packed", "shared"):
        assert [[len(v) for v in row] for row in values[name]] == [[len(r) for r in rows["response_token_ids"][i]]
                                                                   for i in range(len(rows))], name
        for padded_row, row in zip(values["padded"], values[name]):
            for a, b in zip(padded_row, row):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
