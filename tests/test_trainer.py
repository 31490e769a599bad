"""The DeepSpeed worker group: data parallelism over Ray actors computes the same step.

One optimizer step on the same samples with 1 rank (ZeRO 0) and with 2 ranks (ZeRO 3,
parameters sharded and gathered for publishing, samples in micro-batches) must see the
same global gradient norm and loss: the token-level loss is normalised by the global token count, not per rank."""

from __future__ import annotations

import numpy as np

from pipelines.config import load_config
from pipelines.policy_store import create_policy_store
from pipelines.trainer_group import start_trainer_group
from operators.train import _explode, _shard


def step_samples(tokenizer_path: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    eos = tok.eos_token_id
    rows = []
    for index, (prompt, answers) in enumerate([("1+2=", ["3", "4", "13", "3"]), ("7+8=", ["15", "1", "15", "9"])]):
        responses = [tok(a, add_special_tokens=False)["input_ids"] + [eos] for a in answers]
        rows.append({
            "prompt_token_ids": tok(prompt)["input_ids"],
            "response_token_ids": responses,
            # Behaviour log-probs a little off the current policy, so the PPO ratio is not 1.
            "behavior_logprobs": [[-1.0 - 0.1 * j for j in range(len(r))] for r in responses],
            "advantages": [0.9, -0.5, -1.2, 0.8] if index == 0 else [1.1, -0.7, 0.4, -0.8],
        })
    return rows


def one_step(cfg, model_path: str, samples: dict, name: str) -> tuple[list[dict], dict]:
    import ray

    store = create_policy_store(name)
    workers, placement = start_trainer_group(cfg, model_path, name)
    try:
        shards = _shard(samples, len(workers))
        tokens = sum(len(r) for r in samples["response_token_ids"])
        results = ray.get([w.train_step.remote(s, tokens, len(samples["advantages"])) for w, s in zip(workers, shards)])
        version, (ref,) = ray.get(store.get_latest.remote())
        assert version == 1
        return results, ray.get(ref)
    finally:
        for actor in [*workers, store]:
            ray.kill(actor)


def test_two_ranks_zero3_match_one_rank(ray_cluster, tiny_model_path):
    samples = _explode(step_samples(tiny_model_path))
    base = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1", "train.num_cpus=0.4"]
    single = load_config(None, base + ["train.world_size=1", "train.zero_stage=0"])
    # The sharded side also splits each rank's samples into micro-batches (several forwards,
    # one backward under ZeRO-3): the step must still equal the single-rank one.
    # Threshold 0: every parameter is really partitioned, so the publish (a gather) involves both ranks;
    # at DeepSpeed's default the tiny model's parameters all stay whole and nothing is gathered.
    sharded = load_config(None, base + ["train.world_size=2", "train.zero_stage=3", "train.micro_batch_tokens=12",
                                        "train.zero3_persistence_threshold=0"])
    results_1, weights_1 = one_step(single, tiny_model_path, samples, "trainer-test-1")
    results_2, weights_2 = one_step(sharded, tiny_model_path, samples, "trainer-test-2")
    assert len(results_2) == 2 and all(r["micro_batches"] > 1 for r in results_2)
    np.testing.assert_allclose(results_2[0]["grad_norm"], results_1[0]["grad_norm"], rtol=1e-4)
    loss_2 = np.mean([r["policy_loss"] for r in results_2])
    np.testing.assert_allclose(loss_2, results_1[0]["policy_loss"], rtol=1e-4, atol=1e-6)
    assert weights_1.keys() == weights_2.keys()
    # Same update up to float reassociation; Adam's first step is ~lr*sign(g), so compare
    # loosely elementwise and tightly on average.
    for name in weights_1:
        diff = np.abs(weights_1[name] - weights_2[name])
        assert diff.mean() < 1e-5, name


def test_micro_batches_give_the_same_step(tiny_model_path):
    """Splitting a rank's samples into length-sorted micro-batches removes padding, not maths:
    loss, gradient norm and updated weights equal the one-batch step, for a token-normalised
    and a sequence-averaged aggregation. Runs in-process (no Ray): one rank, gloo world of 1."""
    from operators.train_worker import TrainWorker
    from pipelines.trainer_group import _free_port, trainer_settings

    samples = _explode(step_samples(tiny_model_path))
    tokens = sum(len(r) for r in samples["response_token_ids"])
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        outcomes = []
        for budget in (0, 12):
            cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1",
                                     f"algorithm.loss_aggregation={aggregation}", f"train.micro_batch_tokens={budget}"])
            worker = TrainWorker(0, 1, _free_port(), trainer_settings(cfg, tiny_model_path), None)
            result = worker.train_step(samples, tokens, len(samples["advantages"]))
            outcomes.append((result, worker.state_dict()))
        (whole, weights_whole), (split, weights_split) = outcomes
        assert whole["micro_batches"] == 1 and split["micro_batches"] >= 3, (aggregation, split["micro_batches"])
        assert split["num_tokens"] == whole["num_tokens"] == tokens
        np.testing.assert_allclose(split["policy_loss"], whole["policy_loss"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(split["grad_norm"], whole["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(split["entropy"], whole["entropy"], rtol=1e-5)
        np.testing.assert_allclose(split["clip_fraction"], whole["clip_fraction"], atol=1e-9)
        # Adam's first step is ~lr*sign(g): a gradient entry near 0 may flip sign under float
        # reassociation, so bound the rare element by 2*lr and the average tightly.
        for name in weights_whole:
            diff = np.abs(weights_split[name] - weights_whole[name])
            assert diff.mean() < 1e-7 and diff.max() <= 2.0 * cfg.train.lr + 1e-6, (name, diff.mean(), diff.max())
