"""The algorithms on multi-turn episodes and on the edges, through the operators and the DeepSpeed ranks
(in-process, gloo world of 1): the critic trains on the policy's tokens only, under one normaliser, with
its clip centred on the current critic; an empty step is skipped and counted; Dr. GRPO counts the same
responses under one mini-batch and several; the overlong shaping counts the policy's tokens against the
episode's budget; a KL in the reward goes per token under GAE. Each expected value is computed here
from the reference's formula, not by the code under test."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from operators.stages.advantage import Advantage
from operators.algorithms.estimators import gae
from operators.algorithms.step_batch import explode, step_normalisers
from pipelines.config.load import load_config
from samples import episode_samples, step_samples

BASE = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1"]




def make_worker(model_path: str, overrides: list[str], critic: bool = False):
    from operators.workers.train_worker import TrainWorker
    from operators.workers.value_worker import ValueWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import critic_settings, trainer_settings

    cfg = load_config(None, [*BASE, *(["critic.lr=0.01"] if critic else []), *overrides])
    if critic:
        return ValueWorker(0, 1, free_port(), critic_settings(cfg, model_path), None, cfg.critic.value_clip)
    return TrainWorker(0, 1, free_port(), trainer_settings(cfg, model_path), None)


def critic_episode_samples(model_path: str) -> dict:
    samples = episode_samples(model_path)
    returns = [[1.0 if index % 2 else -1.0] * len(r) for index, r in enumerate(samples["response_token_ids"])]
    return {"prompt_token_ids": samples["prompt_token_ids"], "response_token_ids": samples["response_token_ids"],
            "loss_masks": samples["loss_masks"], "returns": returns,
            "old_values": [[0.0] * len(r) for r in samples["response_token_ids"]]}


# ---------------------------------------------------------------- the critic


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_critic_loss_is_half_the_mse_over_the_policys_tokens(tiny_model_path, mini_batches):
    """verl / OpenRLHF critic loss: 1/2 (V - R)^2, token-mean over the trained (policy) tokens of each
    optimizer step's mini-batch. A plain-torch reference from the same initial weights gives the same
    gradient norm and loss, for one mini-batch and for two; observation tokens get no gradient."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    samples = critic_episode_samples(tiny_model_path)
    critic = make_worker(tiny_model_path, ["algorithm.advantage=gae", "critic.value_clip=100",
                                           f"train.mini_batches={mini_batches}"], critic=True)
    initial = critic.state_dict()
    count = len(samples["response_token_ids"])
    partition = critic.mini_batches(count, 0)
    with torch.no_grad():  # V_old = the critic's own values: the clip (100) never bites
        batch = critic._batch_tensors(samples)
        current = critic.values(batch)
    samples["old_values"] = [batch.at_response(current, row).tolist() for row in range(count)]
    tokens = sum(sum(m) for m in samples["loss_masks"])
    sequences = sum(1 for m in samples["loss_masks"] if sum(m))
    result = critic.train_step(samples, tokens, sequences)

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_config(config)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    norms = []
    for part in partition:
        model.zero_grad()
        loss = 0.0
        trained = sum(sum(samples["loss_masks"][i]) for i in part)
        for i in part:
            prompt, response = samples["prompt_token_ids"][i], samples["response_token_ids"][i]
            ids = torch.tensor([[*prompt, *response]])
            values = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) + len(response) - 1, 0]
            mask = torch.tensor(samples["loss_masks"][i], dtype=torch.float32)
            returns = torch.tensor(samples["returns"][i])
            loss = loss + (0.5 * (values - returns) ** 2 * mask).sum() / trained
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                                  if p.grad is not None]))))
        break  # the first optimizer step's gradient is what the rank reports
    np.testing.assert_allclose(result["grad_norm"], norms[0], rtol=1e-4)
    assert result["num_tokens"] == tokens and result["stale_values_refreshed"] == 0


def test_critic_ignores_what_observation_tokens_are_worth(tiny_model_path):
    """The critic's samples as the Train operator builds them from episode rows (split_critic_samples) carry
    the loss masks: the same step with absurd returns at the observation tokens trains the same weights."""
    from operators.algorithms.step_batch import split_critic_samples

    episodes = critic_episode_samples(tiny_model_path)
    trained = []
    for absurd in (False, True):
        rows = step_samples(tiny_model_path)
        start = 0
        for row in rows:  # the episodes back into their groups, with what the Value and Advantage stages add
            size = len(row["response_token_ids"])
            part = slice(start, start + size)
            row["response_token_ids"] = episodes["response_token_ids"][part]
            row["behavior_logprobs"] = [[0.0] * len(r) for r in row["response_token_ids"]]
            row["loss_masks"] = episodes["loss_masks"][part]
            row["returns"] = [[r if m or not absurd else 1000.0 for r, m in zip(rs, ms)]
                              for rs, ms in zip(episodes["returns"][part], row["loss_masks"])]
            row["values"], row["critic_version"] = episodes["old_values"][part], 0
            start += size
        samples = explode(rows)
        critic_samples = split_critic_samples(samples)
        assert "returns" not in samples and critic_samples["loss_masks"] == episodes["loss_masks"]
        critic = make_worker(tiny_model_path, ["algorithm.advantage=gae"], critic=True)
        critic.train_step(critic_samples, *step_normalisers(samples))
        trained.append(critic.state_dict())
    for name in trained[0]:
        np.testing.assert_array_equal(trained[0][name], trained[1][name], err_msg=name)


def test_value_clip_is_centred_on_the_current_critic(tiny_model_path):
    """V_old from an older critic version (generation ran ahead) is replaced by the current critic's values:
    with a tiny clip, stale V_old 5 away would clip every token; recomputed, the first update clips none.
    The same offset V_old from the current version is taken as given (and clips)."""
    samples = critic_episode_samples(tiny_model_path)
    count = len(samples["response_token_ids"])
    tokens = sum(sum(m) for m in samples["loss_masks"])
    outcomes = {}
    for version in (0, 1):
        critic = make_worker(tiny_model_path, ["algorithm.advantage=gae", "critic.value_clip=0.01"], critic=True)
        critic.version = 1  # as after one train step
        with torch.no_grad():
            batch = critic._batch_tensors(samples)
            current = critic.values(batch)
        offset = [(batch.at_response(current, row) + 5.0).tolist() for row in range(count)]
        outcomes[version] = critic.train_step(dict(samples, old_values=offset, critic_version=[version] * count),
                                              tokens, count)
    assert outcomes[0]["stale_values_refreshed"] == count and outcomes[0]["value_clip_fraction"] == 0.0
    assert outcomes[1]["stale_values_refreshed"] == 0 and outcomes[1]["value_clip_fraction"] > 0.9


# ---------------------------------------------------------------- the policy on the edges


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_a_step_with_no_trained_token_is_skipped_and_counted(tiny_model_path, mini_batches):
    """Every episode's reset failed: no token is the policy's. The step trains nothing (the weights stay),
    says so, and still advances the policy version (its data was consumed)."""
    samples = episode_samples(tiny_model_path)
    samples["loss_masks"] = [[0] * len(m) for m in samples["loss_masks"]]
    worker = make_worker(tiny_model_path, [f"train.mini_batches={mini_batches}"])
    before = worker.state_dict()
    tokens, sequences = step_normalisers(samples)
    assert (tokens, sequences) == (0, 0)
    result = worker.train_step(samples, tokens, sequences)
    assert result["empty_updates"] == mini_batches and result["optimizer_steps"] == 0
    assert result["num_tokens"] == 0 and np.isnan(result["policy_loss"]) and worker.version == 1
    for name, value in worker.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_dr_grpo_counts_the_same_responses_under_one_mini_batch_and_several(tiny_model_path):
    """The step's normalisers (what the Train operator passes for one mini-batch) leave out the response with
    no trained token, as the ranks' own count for several mini-batches does."""
    samples = episode_samples(tiny_model_path)
    tokens, sequences = step_normalisers(samples)
    assert sequences == len(samples["loss_masks"]) - 1  # the all-observation episode is not a response
    assert tokens == sum(sum(m) for m in samples["loss_masks"])
    worker = make_worker(tiny_model_path, ["algorithm.advantage=dr_grpo"])
    assert worker.settings.loss_aggregation == "seq_mean_token_sum_norm"  # the config chose it
    ((summed_tokens, summed_sequences),) = worker._global_counts([list(range(len(samples["loss_masks"])))], samples)
    assert (summed_tokens, summed_sequences) == (tokens, sequences)


# ---------------------------------------------------------------- rewards of multi-turn episodes


def _episode_row(masks, rewards, lengths=None):
    return pd.DataFrame({"rewards": [rewards], "loss_masks": [masks],
                         "response_lengths": [lengths or [len(m) for m in masks]],
                         "turns": [["[]"] * len(masks)]})


def test_overlong_shaping_counts_the_policys_tokens_against_the_episode_budget():
    """DAPO's soft punishment on an episode: only its policy tokens count, against the policy's budget for
    the episode (3 turns x 8 tokens, max 32 episode tokens -> 24), and it never goes below -penalty."""
    from pipelines.runtime.trainer_settings import advantage_options

    cfg = load_config("configs/tiny_tools.yaml", ["algorithm.overlong_buffer=4"])
    options = advantage_options(cfg)
    assert options["max_new_tokens"] == 24
    masks = [[1] * 10 + [0] * 20,  # 10 policy tokens in a 30-token episode: far inside the budget
             [1] * 22 + [0] * 6,  # 22: two past the unpunished 20 -> -0.5
             [1] * 30]  # past the budget (not reachable, but never below the floor) -> -1
    out = Advantage(**{**options, "estimator": "grpo_no_std", "overlong_penalty": 1.0})(_episode_row(masks, [1.0] * 3))
    shaped = np.array([1.0, 0.5, 0.0])  # reward + shaping
    np.testing.assert_allclose(out["advantages"][0], shaped - shaped.mean())
    assert out["overlong_shaped"][0] == 2


def test_kl_in_the_reward_is_per_token_under_gae():
    """verl / OpenRLHF: with a critic, the KL penalty is a token reward r_t = -beta (log pi_behave - log pi_ref)_t
    at each policy token, the outcome reward on the last; not one sum on the last token."""
    behave, ref = [[-1.0, -2.0, -0.5]], [[-1.5, -1.0, -0.5]]
    values = [[0.2, 0.1, 0.4]]
    row = pd.DataFrame({"rewards": [[1.0]], "behavior_logprobs": [behave], "ref_logprobs": [ref],
                        "values": [values], "response_lengths": [[3]]})
    out = Advantage(estimator="gae", kl_reward_coef=0.1)(row)
    token_rewards = [-0.1 * (b - r) for b, r in zip(behave[0], ref[0])]
    token_rewards[-1] += 1.0
    # GAE with gamma = lambda = 1 by hand: A_t = sum_{k >= t} r_k - V_t
    expected = [sum(token_rewards[t:]) - values[0][t] for t in range(3)]
    np.testing.assert_allclose(out["advantages"][0][0], expected, atol=1e-12)
    np.testing.assert_allclose(out["kl_reward_penalty"][0], sum(b - r for b, r in zip(behave[0], ref[0])))
    summed, _ = gae(np.array([0.0, 0.0, 1.0 - 0.1 * 0.5]), np.array(values[0]))  # the old, summed placement
    assert not np.allclose(out["advantages"][0][0], summed)
