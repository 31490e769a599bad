"""train.share_prompts in the real trainer (TrainWorker: DeepSpeed, micro-batches, ZeRO stages): the step is
the padded step's, and the forward computes each group's prompt once."""

from __future__ import annotations

import pytest

from operators.algorithms.step_batch import explode
from samples import episode_samples, step_samples
from test_trainer_device import _assert_same_step, _step, _worker


@pytest.mark.parametrize("zero_stage, episodes", [(0, True), (3, False)])
def test_shared_prompt_micro_batches_give_the_padded_step(tiny_model_path, zero_stage, episodes):
    """Loss, gradient norm, entropy and weights equal the padded step's. ZeRO 0 on multi-turn episodes
    (observation tokens, an all-observation episode) with an entropy bonus and two PPO epochs (pi_prox from a
    shared forward); ZeRO 3 with the head partitioned and log-probs in chunks of 2 positions, micro-batches
    cut by units."""
    samples = episode_samples(tiny_model_path) if episodes else explode(step_samples(tiny_model_path))
    sets = [f"train.zero_stage={zero_stage}", "train.zero3_persistence_threshold=0", "train.micro_batch_tokens=16",
            "algorithm.loss_aggregation=seq_mean_token_mean", "algorithm.entropy_coef=0.01"]
    sets += ["train.ppo_epochs=2"] if episodes else ["train.logits_chunk_tokens=2"]
    padded = _step(tiny_model_path, samples, *sets, "train.packing=false")
    shared = _step(tiny_model_path, samples, *sets, "train.share_prompts=true")
    assert shared[2].settings.share_prompts and shared[2]._shared_mask in ("bool", "additive")
    assert shared[0]["micro_batches"] >= 2
    _assert_same_step(padded, shared)


def test_each_prompt_is_computed_once_per_group(tiny_model_path):
    """The tokens the forward runs on, counted: two groups of four responses with the prompt laid out once each,
    against every sequence whole under sequence packing."""
    samples = explode(step_samples(tiny_model_path))
    seen = {}
    for name, sets in (("packed", []), ("shared", ["train.share_prompts=true"])):
        worker = _worker(tiny_model_path, *sets)
        tokens = []
        worker.engine.module.model.embed_tokens.register_forward_hook(
            lambda m, args, out: tokens.append(int((args[0] != worker.pad_id).sum())))
        worker.train_step(samples, sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"]))
        seen[name] = sum(tokens)
    prompts = [len(p) for p in samples["prompt_token_ids"]]
    responses = sum(len(r) for r in samples["response_token_ids"])
    assert seen["packed"] == sum(prompts) + responses
    assert seen["shared"] == prompts[0] + prompts[4] + responses  # one copy per group of 4
