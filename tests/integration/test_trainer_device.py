"""The trainer as a GPU user runs it, checked on CPU wherever CPU can check it: which device and
collective backend a rank picks (from what Ray assigned it), memory that follows the micro-batch
(a backward per micro-batch, log-probs in recomputed chunks, gradient checkpointing) without
changing the step, the learning-rate schedule, and bf16 against fp32."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from operators.algorithms.batching import split_to_count
from operators.common.devices import DeviceError, choose_device, dist_backend
from operators.algorithms.step_batch import explode
from operators.workers.settings import LrSchedule
from pipelines.config.load import load_config
from samples import episode_samples, step_samples

ROOT = Path(__file__).resolve().parents[2]
BASE = ["rollout.n=4", "train.groups_per_step=2", "rollout.groups_per_call=1"]


def test_device_follows_what_ray_assigned():
    assert choose_device(None, cuda_available=True) == "cuda"  # outside Ray: what torch sees
    assert choose_device(None, cuda_available=False) == "cpu"
    assert choose_device(0, cuda_available=True) == "cpu"  # a CPU actor on a GPU node sees every GPU
    assert choose_device(1, cuda_available=True) == "cuda"
    with pytest.raises(DeviceError, match="num_gpus: 0"):
        choose_device(1, cuda_available=False, role="policy rank 0")
    assert dist_backend("cuda") == "nccl" and dist_backend("cpu") == "gloo"


SCRIPT = """
import json, ray, torch
from operators.common.devices import DeviceError, local_device
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote
def device_of():
    try:
        return str(local_device(torch, role="policy rank 0"))
    except DeviceError as err:
        return "error: " + str(err)

print(json.dumps({
    "cpu_actor": ray.get(device_of.options(num_gpus=0).remote()),
    "gpu_actor": ray.get(device_of.options(num_gpus=1).remote()),
    "driver": str(local_device(torch)),
}))
"""


def test_ray_gpu_assignment_decides_the_device():
    """Real Ray with one (fake) GPU on this CPU machine: a task given no GPU computes on the CPU; a task
    given the GPU refuses to fall back silently to the CPU, since this torch has no CUDA."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cpu_actor"] == "cpu" and result["driver"] == "cpu"
    assert result["gpu_actor"].startswith("error: policy rank 0 was given 1 GPU(s)"), result
    assert "make install-gpu" in result["gpu_actor"]


def test_split_to_count_pairs_up_passes():
    chunks = [[4, 2, 7], [0], [1, 3, 5, 6]]
    assert split_to_count(chunks, 4) == [[4, 2, 7], [0], [1, 3], [5, 6]]  # the largest halved, in order
    assert split_to_count(chunks, 5) == [[4], [2, 7], [0], [1, 3], [5, 6]]
    assert split_to_count([[0, 1]], 4) == [[0], [1], [], []]  # fewer samples than passes: empty passes
    assert split_to_count(chunks, 2) == chunks


def _worker(path, *sets):
    from operators.workers.train_worker import TrainWorker
    from operators.workers.deepspeed_setup import free_port
    from pipelines.runtime.trainer_settings import trainer_settings

    cfg = load_config(None, BASE + list(sets))
    return TrainWorker(0, 1, free_port(), trainer_settings(cfg, path), None)


def _step(path, samples, *sets):
    worker = _worker(path, *sets)
    tokens = sum(len(r) for r in samples["response_token_ids"])
    return worker.train_step(samples, tokens, len(samples["advantages"])), worker.state_dict(), worker


def _assert_same_step(a, b, rtol=1e-5, weights_atol=1e-5, lr=0.002):
    """Same step up to float reassociation. Loss, gradient norm and entropy agree to `rtol`. Weights: Adam's
    first update is lr * g / (|g| + eps), so an element whose gradient is near eps (1e-8) moves by a visible
    part of lr for a reassociation-sized change of g (seen: 1 element of 4096 off by 1.2e-5 = 0.006 lr, on
    one machine and not another). So every element stays within lr of the other step, and all but one in
    a thousand within `weights_atol`: a wrong accumulation (a micro-batch lost, counted twice, or misweighted)
    flips the update of many elements by up to 2 lr."""
    (ra, wa, _), (rb, wb, _) = a, b
    np.testing.assert_allclose(rb["policy_loss"], ra["policy_loss"], rtol=rtol, atol=1e-7)
    np.testing.assert_allclose(rb["grad_norm"], ra["grad_norm"], rtol=rtol)
    np.testing.assert_allclose(rb["entropy"], ra["entropy"], rtol=rtol)
    for name in wa:
        diff = np.abs(np.asarray(wb[name], dtype=np.float64) - np.asarray(wa[name], dtype=np.float64))
        assert diff.max() <= lr, (name, float(diff.max()))
        assert (diff > weights_atol).mean() <= 1e-3, (name, int((diff > weights_atol).sum()), diff.size)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_a_backward_per_micro_batch_equals_one_backward(tiny_model_path, zero_stage):
    """Each micro-batch runs its own forward and backward, the gradients accumulate and the last backward
    is the boundary: loss, gradient norm and weights equal the single-batch step, under ZeRO 0, 2 and 3."""
    samples = explode(step_samples(tiny_model_path))
    stage = [f"train.zero_stage={zero_stage}", "train.zero3_persistence_threshold=0"]
    whole = _step(tiny_model_path, samples, *stage)
    split = _step(tiny_model_path, samples, *stage, "train.micro_batch_tokens=12")
    assert whole[0]["micro_batches"] == 1 and split[0]["micro_batches"] >= 3
    _assert_same_step(whole, split)


@pytest.mark.parametrize("zero_stage, episodes", [(0, True), (3, False)])
def test_packed_micro_batches_give_the_padded_step(tiny_model_path, zero_stage, episodes):
    """Packed micro-batches (train.packing, the default) change the layout, not the maths: loss, gradient
    norm, entropy and weights equal the padded step's. ZeRO 0 on multi-turn episodes (observation tokens
    and an all-observation episode) under a sequence-averaged loss with an entropy bonus; ZeRO 3 with the
    head partitioned and log-probs in chunks of 2 positions (the chunks run on the packed rows)."""
    samples = episode_samples(tiny_model_path) if episodes else explode(step_samples(tiny_model_path))
    sets = [f"train.zero_stage={zero_stage}", "train.zero3_persistence_threshold=0", "train.micro_batch_tokens=20",
            "algorithm.loss_aggregation=seq_mean_token_mean", "algorithm.entropy_coef=0.01"]
    if zero_stage == 3:
        sets += ["train.logits_chunk_tokens=2"]
    padded = _step(tiny_model_path, samples, *sets, "train.packing=false")
    packed = _step(tiny_model_path, samples, *sets)
    assert packed[2].settings.packing and not padded[2].settings.packing
    assert packed[0]["micro_batches"] >= 2
    _assert_same_step(padded, packed)


def test_packed_micro_batches_compute_on_fewer_token_slots(tiny_model_path, monkeypatch):
    """What packing saves, counted: the token slots (rows x width) the model's forward runs on, packed
    against padded, for the same step with one micro-batch, on long-tailed lengths (one response ten
    tokens longer than the rest)."""
    rows = step_samples(tiny_model_path)
    rows[0]["response_token_ids"][0] = rows[0]["response_token_ids"][0] * 6
    rows[0]["behavior_logprobs"][0] = rows[0]["behavior_logprobs"][0] * 6
    samples = explode(rows)
    slots = {}
    for packing in ("false", "true"):
        worker = _worker(tiny_model_path, f"train.packing={packing}")
        seen = []
        worker.engine.module.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
        worker.train_step(samples, sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"]))
        slots[packing] = sum(seen)
    tokens = sum(len(p) + len(r) for p, r in zip(samples["prompt_token_ids"], samples["response_token_ids"]))
    assert tokens <= slots["true"] <= 0.7 * slots["false"], (tokens, slots)


def test_chunked_logprobs_equal_the_full_ones(tiny_model_path):
    """The log-probs and entropy from the final hidden states in chunks of 1, 3 and 7 positions equal
    those of the full logits, and so do their gradients (the chunks are recomputed in backward)."""
    import torch
    from transformers import AutoModelForCausalLM

    from operators.algorithms.losses import chunked_token_logprobs, entropy_from_logits, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))

    def run(chunk):
        model.zero_grad()
        out = model(input_ids=ids, output_hidden_states=True)
        if chunk is None:
            logits = out.logits[:, :-1].float() / 0.7
            logprobs, entropy = token_logprobs(logits, ids[:, 1:]), entropy_from_logits(logits)
        else:
            hidden = out.hidden_states[-1][:, :-1]
            logprobs, entropy = chunked_token_logprobs(hidden, model.get_output_embeddings(), ids[:, 1:], 0.7, chunk,
                                                       entropy_grad=True)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), entropy.detach(), grads

    full_logprobs, full_entropy, full_grads = run(None)
    for chunk in (1, 3, 7):
        logprobs, entropy, grads = run(chunk)
        torch.testing.assert_close(logprobs, full_logprobs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(entropy, full_entropy, rtol=1e-5, atol=1e-6)
        assert grads.keys() == full_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-3, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_chunked_logits_and_gradient_checkpointing_leave_the_step_unchanged(tiny_model_path):
    samples = explode(step_samples(tiny_model_path))
    plain = _step(tiny_model_path, samples, "train.logits_chunk_tokens=0", "algorithm.entropy_coef=0.01")
    chunked = _step(tiny_model_path, samples, "train.logits_chunk_tokens=5", "algorithm.entropy_coef=0.01")
    checkpointed = _step(tiny_model_path, samples, "train.gradient_checkpointing=true", "algorithm.entropy_coef=0.01")
    _assert_same_step(plain, chunked)
    _assert_same_step(plain, checkpointed)


def test_zero3_gathers_the_lm_head_once_per_micro_batch_for_all_its_chunks(tiny_model_path, monkeypatch):
    """ZeRO-3 with the head really partitioned (threshold 0) and log-prob chunks of 2 positions, several per
    micro-batch: the head is gathered once per micro-batch (engine_steps.gathered_head) for its chunks, their
    recomputes in backward and its gradient, and the head module itself runs once per micro-batch (the
    model's own logits of one position), not once per chunk and recompute. The gradient still reaches the
    sharded head: the step equals ZeRO-0's with the full logits."""
    import operators.workers.train_worker as train_worker

    gathers, gathered_head = [], train_worker.gathered_head

    def counted(deepspeed, head, zero_stage):
        gathers.append(zero_stage)
        return gathered_head(deepspeed, head, zero_stage)

    monkeypatch.setattr(train_worker, "gathered_head", counted)  # counts, then gathers as before
    samples = explode(step_samples(tiny_model_path))
    plain = _step(tiny_model_path, samples, "train.logits_chunk_tokens=0")
    assert gathers == []  # full logits: no chunk, no gather of ours
    worker = _worker(tiny_model_path, "train.zero_stage=3", "train.zero3_persistence_threshold=0",
                     "train.micro_batch_tokens=12", "train.logits_chunk_tokens=2")
    head_calls = []
    worker.engine.module.get_output_embeddings().register_forward_pre_hook(lambda *_: head_calls.append(1))
    tokens = sum(len(r) for r in samples["response_token_ids"])
    result = worker.train_step(samples, tokens, len(samples["advantages"]))
    passes = result["micro_batches"]
    assert passes >= 3 and max(len(r) for r in samples["response_token_ids"]) > 2  # several chunks per pass
    assert gathers == [3] * passes and len(head_calls) == passes
    _assert_same_step(plain, (result, worker.state_dict(), worker))


@pytest.mark.parametrize("zero_stage, dtype", [(0, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")])
def test_nonfinite_loss_in_a_later_micro_batch_drops_the_accumulated_gradients(tiny_model_path, zero_stage, dtype):
    """The poisoned sample lands in the last micro-batch, after others were backwarded: the step is
    skipped, no weight moves, and the next step equals a fresh rank's first step (no gradient of the
    skipped step was left behind)."""
    from operators.algorithms.step_batch import micro_batch_chunks

    samples = explode(step_samples(tiny_model_path))
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"])
    last = micro_batch_chunks(samples, 12, packed=True)[-1][0]  # the packed micro-batches' order
    poisoned = {**samples, "advantages": [1e308 if i == last else a for i, a in enumerate(samples["advantages"])]}
    sets = [f"train.zero_stage={zero_stage}", "train.micro_batch_tokens=12", "train.zero3_persistence_threshold=0",
            f"train.dtype={dtype}"]
    worker = _worker(tiny_model_path, *sets)
    before = worker.state_dict()
    skipped = worker.train_step(poisoned, tokens, count)
    assert skipped["nonfinite_skipped"] == 1 and skipped["micro_batches"] >= 2  # others were backwarded first
    for name, array in worker.state_dict().items():
        np.testing.assert_array_equal(array, before[name], err_msg=name)
    after_skip = worker.train_step(samples, tokens, count)
    fresh = _step(tiny_model_path, samples, *sets)
    np.testing.assert_allclose(after_skip["grad_norm"], fresh[0]["grad_norm"], rtol=1e-5)
    for name, array in worker.state_dict().items():
        np.testing.assert_allclose(array, fresh[1][name], atol=1e-6, err_msg=name)


def test_lr_schedule_warmup_then_cosine():
    schedule = LrSchedule(warmup_steps=4, total_steps=14, kind="cosine", min_ratio=0.1)
    factors = [schedule.factor(step) for step in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and math.isclose(factors[-1], 0.1)
    assert all(a > b for a, b in zip(factors[4:], factors[5:]))  # decays monotonically after warm-up
    assert [LrSchedule(warmup_steps=2).factor(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert LrSchedule().factor(0) == 1.0


def test_the_rank_follows_the_lr_schedule_and_a_checkpoint_keeps_it(tiny_model_path, tmp_path):
    """Two updates per train step (mini_batches 2): warm-up over 2 train steps is 4 optimizer steps."""
    samples = explode(step_samples(tiny_model_path))
    tokens, count = sum(len(r) for r in samples["response_token_ids"]), len(samples["advantages"])
    sets = ["train.lr=0.01", "train.lr_warmup_steps=2", "train.mini_batches=2", "train.steps=5",
            "train.lr_schedule=cosine"]
    worker = _worker(tiny_model_path, *sets)
    assert math.isclose(worker.engine.get_lr()[0], 0.01 / 4)
    worker.train_step(samples, tokens, count)
    assert math.isclose(worker.engine.get_lr()[0], 0.01 * 3 / 4)
    worker.save_checkpoint(str(tmp_path))
    worker.train_step(samples, tokens, count)
    lr_then = worker.engine.get_lr()[0]
    assert math.isclose(lr_then, 0.01 * LrSchedule(4, 10, "cosine").factor(4))
    fresh = _worker(tiny_model_path, *sets)
    fresh.load_checkpoint(str(tmp_path), version=1)
    assert math.isclose(fresh.engine.get_lr()[0], 0.01 * 3 / 4)
    fresh.train_step(samples, tokens, count)
    assert math.isclose(fresh.engine.get_lr()[0], lr_then)


def test_bf16_step_matches_fp32_within_bf16_precision(tiny_model_path):
    """DeepSpeed bf16 (ZeRO-1, fp32 master weights) against fp32: bf16 has an 8-bit mantissa (~0.4%
    relative per operation), so the loss agrees to 2%, the gradient norm to 5%, and the update (Adam's
    first step moves each weight by ~lr) to a small fraction of lr."""
    samples = explode(step_samples(tiny_model_path))
    fp32 = _step(tiny_model_path, samples, "train.zero_stage=1")
    bf16 = _step(tiny_model_path, samples, "train.zero_stage=1", "train.dtype=bf16")
    np.testing.assert_allclose(bf16[0]["policy_loss"], fp32[0]["policy_loss"], rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(bf16[0]["grad_norm"], fp32[0]["grad_norm"], rtol=5e-2)
    from deepspeed.utils import safe_get_full_fp32_param

    lr = load_config(None, BASE).train.lr
    before = _worker(tiny_model_path).state_dict()
    module = bf16[2].engine.module
    assert {str(p.dtype) for p in module.parameters()} == {"torch.bfloat16"}  # the module computes in bf16
    masters = {name: safe_get_full_fp32_param(p).detach().numpy() for name, p in module.named_parameters()}
    torch = __import__("torch")
    for name, master in masters.items():  # fp32 master weights: the update is the fp32 one
        start = torch.from_numpy(before[name]).bfloat16().float().numpy()  # the masters start from bf16 weights
        fp32_update, bf16_update = fp32[1][name] - before[name], master - start
        assert np.abs(bf16_update - fp32_update).mean() < 0.25 * lr, name
        assert np.abs(bf16_update).mean() > 0.5 * lr, name  # and it is an update (Adam's first step ~ lr)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_rank_loads_and_exports_in_the_training_dtype(tiny_model_path, tmp_path, dtype):
    """ZeRO-2: the rank loads the model in the training dtype (no fp32 copy of a bf16 run's model on every rank;
    DeepSpeed keeps the fp32 masters in its optimizer) and the HF export writes the trained module's weights
    in that dtype, its config saying the same; fp32 exports exactly the fp32 weights, as before."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    expected, name_of = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}[dtype]
    samples = explode(step_samples(tiny_model_path))
    _, weights, worker = _step(tiny_model_path, samples, "train.zero_stage=2", f"train.dtype={dtype}")
    module = worker.engine.module
    assert module.config.dtype == expected  # from_pretrained's dtype (DeepSpeed's own cast would leave float32 here)
    assert {p.dtype for p in module.parameters()} == {expected}
    worker.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        exported = {name: stored.get_tensor(name) for name in stored.keys()}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == name_of
    assert exported.keys() == dict(module.named_parameters()).keys()
    for name, param in module.named_parameters():
        assert exported[name].dtype == expected and torch.equal(exported[name], param.detach()), name
        if dtype == "fp32":
            np.testing.assert_array_equal(exported[name].numpy(), weights[name], err_msg=name)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True, dtype="auto")
    assert {p.dtype for p in reloaded.parameters()} == {expected}


def test_shards_are_balanced_by_tokens():
    from operators.algorithms.batching import balanced_shards

    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = [int(x) for x in np.minimum(rng.lognormal(4, 1, size=int(rng.integers(8, 64))), 2048) + 1]
        parts = int(rng.integers(2, 8))
        shards = balanced_shards(lengths, parts)
        assert sorted(i for shard in shards for i in shard) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in shard) for shard in shards]
        assert max(loads) - min(loads) <= max(lengths)  # equal within one sample
        assert all(shard for shard in shards)
        equal = balanced_shards(lengths, parts, equal_counts=True)
        if len(lengths) % parts == 0:
            assert {len(shard) for shard in equal} == {len(lengths) // parts}
    # long-tailed: count-based halves would give one rank 1010 tokens and the other 40
    assert [sum([1000, 10, 10, 10, 10, 10, 10, 10][i] for i in s) for s in
            balanced_shards([1000, 10, 10, 10, 10, 10, 10, 10], 2)] == [1000, 70]


def test_token_batch_places_each_column_on_its_response_tokens():
    """Shifted coordinates: position t of a per-token column is the value for predicting token t + 1, so a
    response's values sit from prompt length - 1 on; a per-response float is broadcast; the mask marks
    exactly those positions; an optional column is kept only when every sample has it; a wrong count,
    a missing required column and an unknown column are errors that name it."""
    import torch

    from operators.algorithms.batching import token_batch

    samples = {"prompt_token_ids": [[5, 6, 7], [8]], "response_token_ids": [[1, 2], [3, 4, 9]],
               "behavior_logprobs": [[-0.5, -1.5], [-1.0, -2.0, -3.0]], "advantages": [1.0, [0.1, 0.2, 1e39]],
               "ref_logprobs": [[-0.1, -0.2], None], "staleness": [2, 0]}
    batch = token_batch(samples, pad_id=0, required=("behavior_logprobs", "advantages"),
                        optional=("ref_logprobs",), device="cpu")
    assert batch.rows == 2 and batch.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert batch.attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch.at_response(batch.behavior_logprobs, 0).tolist() == [-0.5, -1.5]
    assert batch.at_response(batch.behavior_logprobs, 1).tolist() == [-1.0, -2.0, -3.0]
    assert batch.advantages[0].tolist() == [0, 0, 1, 1]
    assert batch.advantages[1, 2].item() == float("inf")  # overflow reaches the NaN guard instead of raising
    assert batch.ref_logprobs is None and batch.staleness.tolist() == [2, 0]
    assert batch.require("advantages")[0] is batch.advantages
    with pytest.raises(ValueError, match="no ref_logprobs column"):
        batch.require("ref_logprobs")
    with pytest.raises(ValueError, match="sample 1: 2 behavior_logprobs for 3 response tokens"):
        token_batch({**samples, "behavior_logprobs": [[-0.5, -1.5], [-1.0, -2.0]]}, 0, ("behavior_logprobs",))
    with pytest.raises(ValueError, match="no returns column"):
        token_batch(samples, 0, ("returns",))
    with pytest.raises(ValueError, match="'logits'.*not TokenBatch columns"):
        token_batch(samples, 0, ("logits",))
    assert token_batch(samples, 0, ("advantages",)).to(torch.device("cpu")).mask.dtype == torch.float32
