"""The DeepSpeed worker group: data parallelism over Ray actors computes the same step.

One optimizer step on the same samples with 1 rank (ZeRO 0) and with 2 ranks (ZeRO 3,
parameters sharded and gathered for publishing, samples in micro-batches) must see the
same global gradient norm and loss: the token-level loss is normalised by the global token count, not per rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipelines.config.load import load_config
from pipelines.runtime.policy_store import create_policy_store
from pipelines.runtime.trainer_group import start_trainer_group
from operators.algorithms.step_batch import explode, shard, step_normalisers
from operators.weights.object_store import fetch
from reference_step import reference_updates
from samples import episode_rows, episode_samples, step_samples




def one_step(cfg, model_path: str, samples: dict, name: str, export: Path | None = None) -> tuple[list[dict], dict]:
    """One train step of the group: each rank's figures, and the weights version 1 published; the served-policy
    probe's record in `results[0]["probe"]`; with `export`, the Hugging Face export written there by every rank."""
    import ray

    store = create_policy_store(name)
    workers, placement = start_trainer_group(cfg, model_path, store)
    try:
        shards = shard(samples, len(workers))
        tokens, sequences = step_normalisers(samples)
        results = ray.get([w.train_step.remote(s, tokens, sequences) for w, s in zip(workers, shards)])
        version, ref = store.latest()
        assert version == 1
        results[0]["probe"] = store.probe_of(1)  # put before the version was published
        if export is not None:  # every rank: a collective under ZeRO-3
            ray.get([w.save_pretrained.remote(str(export)) for w in workers])
        # what a generator receives: the manifest's buckets (under ZeRO-3 gathered module by module)
        return results, fetch(ref).float32_arrays()
    finally:
        store.kill()
        for actor in workers:
            ray.kill(actor)


# token_mean in CI, with every weight and with LoRA adapters; the sequence aggregations over episodes with
# make test-extended (CI stays under 45 minutes; their maths is checked against the reference in
# tests/unit/test_algorithm_reference.py).
@pytest.mark.parametrize("aggregation,episodes,lora", [
    ("token_mean", False, None),
    ("token_mean", False, "{r: 4, alpha: 8}"),
    pytest.param("seq_mean_token_mean", True, None, marks=pytest.mark.extended),
    pytest.param("seq_mean_token_sum_norm", True, None, marks=pytest.mark.extended),
], ids=["token_mean", "token_mean-lora", "seq_mean_token_mean-episodes", "seq_mean_token_sum_norm-episodes"])
def test_two_ranks_zero3_match_one_rank(ray_cluster, tiny_model_path, aggregation, episodes, lora, tmp_path):
    """The ranks' shards are balanced by tokens, so they hold different numbers of samples here: the
    losses still add up to the one-rank step, for a token-normalised, a sequence-averaged and Dr. GRPO's
    loss, the last two on multi-turn episodes (observation tokens, one episode with none of the policy's).
    With LoRA (train.lora), the adapters' gradients reach both shards and the published weights, each adapted
    layer gathered with its adapters and merged (operators/weights/lora_merge.py), are the one-rank ones."""
    if lora:
        pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")

    rows = episode_rows(tiny_model_path) if episodes else step_samples(tiny_model_path)
    first = rows[0]
    long_response = first["response_token_ids"][0] * 10  # one long response among short ones
    first["response_token_ids"][0] = long_response
    first["behavior_logprobs"][0] = [-1.0 - 0.05 * j for j in range(len(long_response))]
    if episodes:
        first["loss_masks"][0] = first["loss_masks"][0] * 10
    samples = explode(rows)
    shards = shard(samples, 2)
    assert len(shards[0]["advantages"]) != len(shards[1]["advantages"])
    base = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1", "train.num_cpus=0.4",
            f"algorithm.loss_aggregation={aggregation}", *([f"train.lora={lora}", "train.lr=0.02"] if lora else [])]
    single = load_config(None, base + ["train.world_size=1", "train.zero_stage=0"])
    # The sharded side also splits each rank's samples into micro-batches (several forwards,
    # one backward under ZeRO-3): the step must still equal the single-rank one.
    # Threshold 0: every parameter is really partitioned, so the publish (a gather) involves both ranks;
    # at DeepSpeed's default the tiny model's parameters all stay whole and nothing is gathered. Log-probs in
    # chunks of 2 positions: the sharded LM head is gathered once per micro-batch for all of them and its
    # gradient still reaches both shards.
    sharded = load_config(None, base + ["train.world_size=2", "train.zero_stage=3", "train.micro_batch_tokens=12",
                                        "train.zero3_persistence_threshold=0", "train.logits_chunk_tokens=2"])
    results_1, weights_1 = one_step(single, tiny_model_path, samples, "trainer-test-1", tmp_path / "one")
    results_2, weights_2 = one_step(sharded, tiny_model_path, samples, "trainer-test-2", tmp_path / "two")
    # the served-policy probe: scored by both ZeRO-3 ranks together (a collective forward), as by one rank
    probe_1, probe_2 = results_1[0]["probe"], results_2[0]["probe"]
    assert probe_1.version == probe_2.version == 1 and probe_1.token_ids == probe_2.token_ids
    np.testing.assert_allclose(probe_2.logprobs, probe_1.logprobs, atol=1e-4)
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
    if lora:  # the base model's names, and the adapted layers moved
        from safetensors.numpy import load_file

        pretrained = load_file(f"{tiny_model_path}/model.safetensors")
        assert weights_1.keys() >= pretrained.keys() and not any("lora" in name for name in weights_1)
        moved = [name for name in pretrained if np.abs(weights_1[name] - pretrained[name]).max() > 1e-4]
        assert moved and all(name.endswith("_proj.weight") for name in moved), moved
        # the adapter folder beside the export (operators/workers/lora.py): gathered under ZeRO-3, the same
        adapter_1, adapter_2 = (load_file(f"{tmp_path / side}/adapter/adapter_model.safetensors") for side in ("one", "two"))
        assert adapter_1.keys() == adapter_2.keys() and all(".lora_" in name for name in adapter_1)
        for name in adapter_1:
            assert adapter_2[name].shape == adapter_1[name].shape and np.abs(adapter_2[name] - adapter_1[name]).mean() < 1e-5
    else:
        assert not (tmp_path / "one" / "adapter").exists()


def test_micro_batches_give_the_same_step(tiny_model_path):
    """Splitting a rank's samples into length-sorted micro-batches removes padding, not maths:
    loss, gradient norm and updated weights equal the one-batch step, for a token-normalised
    and a sequence-averaged aggregation. Runs in-process (no Ray): one rank, gloo world of 1."""
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    samples = explode(step_samples(tiny_model_path))
    tokens = sum(len(r) for r in samples["response_token_ids"])
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        outcomes = []
        for budget in (0, 12):
            cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1",
                                     f"algorithm.loss_aggregation={aggregation}", f"train.micro_batch_tokens={budget}"])
            worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), None)
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


@pytest.mark.parametrize("overrides", [
    [],  # today's update: ppo_clip, one optimizer step per train step
    ["train.mini_batches=2"],
    ["algorithm.policy_loss=decoupled_ppo", "train.ppo_epochs=2", "train.mini_batches=2", "algorithm.tis=token",
     "algorithm.tis_cap=1.05", "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2", "algorithm.entropy_coef=0.01",
     "reference={}"],
    "multi-turn",  # episodes: policy and observation tokens, one all-observation episode; Dr. GRPO, sequence TIS
], ids=["ppo_clip-1x1", "ppo_clip-1x2", "decoupled_tis_kl_entropy-2x2", "episodes_dr_grpo_tis_sequence-2x2"])
def test_train_step_equals_a_plain_torch_reference(tiny_model_path, overrides):
    """Loss, gradient norm and weights after a train step equal the plain-torch reference: ppo_epochs x
    mini_batches optimizer steps, each on its own mini-batch, pi_prox fixed before the first of several."""
    from operators.algorithms.correction import merge_mismatch
    from operators.algorithms.step_batch import step_normalisers
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    samples = explode(step_samples(tiny_model_path))
    if overrides == "multi-turn":
        samples = episode_samples(tiny_model_path)
        overrides = ["algorithm.advantage=dr_grpo", "algorithm.policy_loss=decoupled_ppo", "algorithm.tis=sequence",
                     "algorithm.tis_cap=1.05", "train.ppo_epochs=2", "train.mini_batches=2"]
    # reference log-probs a little off the behaviour ones, so the KL term is not 0
    samples["ref_logprobs"] = [[lp - 0.3 for lp in lps] for lps in samples["behavior_logprobs"]]
    tokens, sequences = step_normalisers(samples)
    cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1"] + overrides)
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), None)
    count = len(samples["advantages"])
    partitions = [worker.mini_batches(count, epoch) for epoch in range(cfg.train.ppo_epochs)]
    result = worker.train_step(samples, tokens, sequences)
    losses, norms, weights = reference_updates(tiny_model_path, samples, cfg, partitions)

    assert result["optimizer_steps"] == len(losses) == cfg.train.ppo_epochs * cfg.train.mini_batches
    assert worker.version == 1  # one policy version per train step, however many optimizer steps
    np.testing.assert_allclose(result["policy_loss"], np.mean(losses), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([result["grad_norm"], result["grad_norm_last"]], [norms[0], norms[-1]], rtol=1e-5)
    # Adam's early steps are ~lr*sign(g): a gradient entry near 0 may flip sign under float reassociation,
    # so bound the rare element by 2*lr per optimizer step and the average tightly.
    for name, value in worker.state_dict().items():
        diff = np.abs(value - weights[name])
        assert diff.mean() < 1e-7 and diff.max() <= 2 * cfg.train.lr * len(losses), (name, diff.mean(), diff.max())
    mismatch = merge_mismatch(result["mismatch"])
    assert mismatch["is_tokens"] == tokens  # every token measured once, not once per epoch
    if cfg.algorithm.tis != "none":
        assert 0 < mismatch["tis_fraction"] < 1  # the cap 1.05 bites on some tokens, not all
        assert result["kl_ref"] > 0


def test_kl_without_reference_logprobs_is_refused(tiny_model_path):
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    samples = explode(step_samples(tiny_model_path))
    cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1",
                             "algorithm.kl_coef=0.1", "reference={}"])  # configured, but no stage added them
    worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), None)
    with pytest.raises(ValueError, match="algorithm.kl_coef is 0.1 but samples carry no ref_logprobs"):
        worker.train_step(samples, 10, len(samples["advantages"]))
    assert worker.version == 0


def test_per_token_advantages_equal_broadcast_scalars(tiny_model_path):
    """An advantage given per response token (GAE's shape) trains exactly like the same value given once."""
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    scalar = explode(step_samples(tiny_model_path))
    per_token = dict(scalar, advantages=[[a] * len(r) for a, r in zip(scalar["advantages"], scalar["response_token_ids"])])
    tokens = sum(len(r) for r in scalar["response_token_ids"])
    cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1"])
    outcomes = []
    for samples in (scalar, per_token):
        worker = TrainWorker(0, 1, free_port(), trainer_settings(cfg, tiny_model_path), None)
        outcomes.append((worker.train_step(samples, tokens, len(samples["advantages"])), worker.state_dict()))
    (a, weights_a), (b, weights_b) = outcomes
    assert a["policy_loss"] == b["policy_loss"] and a["grad_norm"] == b["grad_norm"]
    assert all(np.array_equal(weights_a[k], weights_b[k]) for k in weights_a)
    wrong = dict(per_token, advantages=[adv[:-1] for adv in per_token["advantages"]])
    with pytest.raises(ValueError, match="advantages for"):
        worker.train_step(wrong, tokens, len(wrong["advantages"]))


def test_train_operator_whitens_the_step_and_reports_mismatch_by_staleness(ray_cluster, tiny_model_path, tmp_path):
    """The Train operator in front of a real rank: REINFORCE++ advantages are whitened over the whole
    step's tokens (mean 0, std 1 with each response counted once per token, as verl's masked_whiten and
    OpenRLHF do; in the logged rollouts), and the mismatch statistics come per staleness level (the
    groups were generated by versions 1 and 2 for step 2). The step's rollouts are a file the operator
    wrote before its row left, named in the row and in the checkpoint's rows (a driver that dies before it
    reads the row loses nothing)."""
    import pandas as pd

    from pipelines.recovery.checkpoint import CheckpointDir, StepCheckpoints
    import ray

    from operators.stages.train import Train

    cfg = load_config(None, ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1",
                             "train.num_cpus=0.4"])
    store = create_policy_store("trainer-test-whiten")
    workers, _ = start_trainer_group(cfg, tiny_model_path, store)
    try:
        rows = step_samples(tiny_model_path)
        for index, row in enumerate(rows):
            row.update(group_uid=f"g{index}", prompt_id=index, epoch=0, train_step=2, policy_version=1 + index,
                       prompt="p", responses=["r"] * 4, response_lengths=[len(r) for r in row["response_token_ids"]],
                       rewards=[1.0, 0.0, 0.0, 1.0], reward_errors=0, reward_timeouts=0,
                       advantages=[1.0, 0.0, 0.0, 3.0] if index == 0 else [2.0, 2.0, 2.0, 4.0])
        train = Train(workers, groups_per_step=2, total_steps=1, first_step=2, whiten_advantages="token",
                      rollouts_dir=str(tmp_path / "rollouts"), checkpoints=StepCheckpoints(str(tmp_path / "run")))
        (out,) = list(train(pd.DataFrame(rows)))
        metrics = out.iloc[0]
        assert "rollouts_parquet" not in metrics and metrics["rollouts_path"] == str(tmp_path / "rollouts" / "step_000003.parquet")
        assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_000003.parquet"]  # no temporary left
        (kept,) = CheckpointDir(tmp_path / "run").at_step(3).step_rows()
        assert kept["rollouts_path"] == metrics["rollouts_path"] and kept["step"] == 3
        logged = pd.read_parquet(metrics["rollouts_path"])
        values = np.concatenate([np.asarray(a, dtype=float) for a in logged["advantages"]])
        # values 1, 0, 0, 3, 2, 2, 2, 4, each weighted by its response's token count
        raw = np.array([1, 0, 0, 3, 2, 2, 2, 4], dtype=float)
        weights = np.array([len(r) for row in rows for r in row["response_token_ids"]], dtype=float)
        assert len(set(weights)) > 1  # unequal lengths: token and response weighting differ here
        mean = (weights * raw).sum() / weights.sum()
        std = np.sqrt((weights * (raw - mean) ** 2).sum() / weights.sum())
        np.testing.assert_allclose(values, (raw - mean) / (std + 1e-6), atol=1e-6)
        assert sorted(logged["staleness"]) == [0, 1]
        tokens = {level: metrics[f"is_tokens_staleness_{level}"] for level in (0, 1)}
        assert tokens[0] + tokens[1] == metrics["is_tokens"] == sum(len(r) for row in rows for r in row["response_token_ids"])
        assert metrics["policy_version"] == 3 and metrics["optimizer_steps"] == 1
    finally:
        store.kill()
        for actor in workers:
            ray.kill(actor)
