"""The RefLogprob operator: its log-probs are the engine's for the same weights, chunking (of sequences, and
of positions through the LM head) changes nothing, and it runs as the DAG's ref_logprob stage; the HF engine
scores its samples through the same chunked head."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

from operators.stages.generate import Generate
from operators.algorithms.chunking import length_sorted_chunks
from operators.stages.ref_logprob import RefLogprob
from pipelines.config.base import ConfigError
from pipelines.config.load import load_config


def generated(tiny_model_path: str, temperature: float) -> pd.DataFrame:
    generate = Generate(tiny_model_path, n=4, max_new_tokens=4, temperature=temperature, seed=3)
    prompts = pd.DataFrame({"prompt_id": ["a", "b", "c"], "prompt": ["1+2=", "9+9=", "0+7="]})
    return generate.sample(prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_logprobs_equal_the_engines_for_the_same_weights(tiny_model_path, temperature):
    rows = generated(tiny_model_path, temperature)
    scored = RefLogprob(tiny_model_path, temperature=temperature)(rows)
    assert scored["prompt_id"].tolist() == ["a", "b", "c"]  # columns pass through
    for behaviour, reference, tokens in zip(scored["behavior_logprobs"], scored["ref_logprobs"],
                                            scored["response_token_ids"]):
        assert [len(r) for r in reference] == [len(t) for t in tokens]
        np.testing.assert_allclose(np.concatenate(reference), np.concatenate(behaviour), atol=1e-4)


def test_chunked_scoring_equals_one_batch(tiny_model_path):
    rows = generated(tiny_model_path, 1.0)
    whole = RefLogprob(tiny_model_path, micro_batch_tokens=10**6)(rows)["ref_logprobs"]
    chunked = RefLogprob(tiny_model_path, micro_batch_tokens=8)(rows)["ref_logprobs"]  # one sequence a chunk
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), atol=1e-5)
    assert length_sorted_chunks([5, 1, 3, 9], budget=10) == [[1, 2], [0], [3]]  # sorted by length; 3 x 5 > 10 pads too much


def test_packed_scoring_equals_padded(tiny_model_path):
    """train.packing reaches the reference model: packed rows (the default) and padded ones give the same
    log-probs, chunked or not."""
    rows = generated(tiny_model_path, 0.7)
    padded = RefLogprob(tiny_model_path, temperature=0.7, packing=False)(rows)["ref_logprobs"]
    for budget in (10**6, 12):
        packed = RefLogprob(tiny_model_path, temperature=0.7, micro_batch_tokens=budget)(rows)["ref_logprobs"]
        for a, b in zip(padded, packed):
            assert [len(x) for x in a] == [len(x) for x in b]
            np.testing.assert_allclose(np.concatenate(b), np.concatenate(a), atol=1e-5)


def test_shared_prompt_scoring_equals_padded(tiny_model_path):
    """train.share_prompts reaches the reference model: each group's prompt once, before its 4 responses, gives
    the padded log-probs: whole, in micro-batches of a group or less, and with the head on 3 positions at a time."""
    rows = generated(tiny_model_path, 0.7)
    padded = RefLogprob(tiny_model_path, temperature=0.7, packing=False)(rows)["ref_logprobs"]
    for budget, head_chunk in ((10**6, 2048), (14, 3)):
        ref = RefLogprob(tiny_model_path, temperature=0.7, micro_batch_tokens=budget, share_prompts=True,
                         logits_chunk_tokens=head_chunk)
        assert ref.shared_mask in ("bool", "additive")
        shared = ref(rows)["ref_logprobs"]
        for a, b in zip(padded, shared):
            assert [len(x) for x in a] == [len(x) for x in b]
            np.testing.assert_allclose(np.concatenate(b), np.concatenate(a), atol=1e-5)
    with pytest.raises(ValueError, match="needs packing=True"):
        RefLogprob(tiny_model_path, packing=False, share_prompts=True)


def test_reference_config_is_checked_up_front(tmp_path):
    assert load_config(None, ["reference.num_actors=2"]).reference.model_path is None  # the starting policy
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"reference.model_path={tmp_path / 'missing'}"])
    assert "does not exist" in dict(err.value.problems)["reference.model_path"]


class LargestLogits(TorchFunctionMode):
    """Watches every torch call's result: the most elements of any [.., V]-shaped (2-D or 3-D) tensor made,
    logits or anything as large (the [B, L, V] logits, their softmax, a stack of per-step logits)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() in (2, 3) and tensor.shape[-1] == self.vocab:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_the_head_runs_a_chunk_of_positions_at_a_time_with_the_same_logprobs(tiny_model_path):
    """logits_chunk_tokens smaller than the batch's positions gives the log-probs of the full logits (0), and
    no tensor as large as the batch's [B, L, V] logits is ever made: at most a chunk's rows x positions x V."""
    rows = generated(tiny_model_path, 0.7)
    full, chunked = (RefLogprob(tiny_model_path, temperature=0.7, logits_chunk_tokens=tokens) for tokens in (0, 24))
    vocab = full.model.config.vocab_size
    with LargestLogits(vocab) as whole:
        expected = full(rows)["ref_logprobs"]
    with LargestLogits(vocab) as parts:
        scored = chunked(rows)["ref_logprobs"]
    for a, b in zip(expected, scored):
        np.testing.assert_allclose(np.concatenate(b), np.concatenate(a), rtol=1e-5, atol=1e-6)
    assert parts.largest <= 24 * vocab < whole.largest


def test_hf_engine_scores_its_samples_a_chunk_at_a_time(tiny_model_path):
    """The HF engine's behaviour log-probs, scored after generation a chunk of positions at a time, equal
    log_softmax(logits / T) of the logits generate sampled each token from (its own per-step logits, asked
    for here), and no [B*n, T, V] tensor is made: at most a chunk's, or one decode step's [B*n, V]."""
    from operators.engines.base import SamplingParams
    from operators.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path, logits_chunk_tokens=8)
    vocab = engine.model.config.vocab_size
    prompts = engine.encode(["1+2=", "19+23="])
    params = SamplingParams(n=4, max_new_tokens=6, min_new_tokens=6, temperature=0.7, seed=3)
    with LargestLogits(vocab) as watched:
        groups = engine.generate(prompts, params)
    padded = engine.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    torch.manual_seed(params.seed)
    out = engine.model.generate(**padded, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=6,
                                min_new_tokens=6, num_return_sequences=4, eos_token_id=list(engine.stop_ids),
                                pad_token_id=engine.pad_id, return_dict_in_generate=True, output_logits=True)
    logits = torch.stack(out.logits, dim=1).float() / 0.7  # [B*n, T, V], what the engine no longer holds
    new_tokens = out.sequences[:, padded["input_ids"].shape[1]:]  # [B*n, T]
    expected = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B*n, T]
    samples = [(tokens, logprobs) for group in groups for tokens, logprobs in zip(group.token_ids, group.logprobs)]
    assert len(samples) == 8
    for row, (tokens, logprobs) in enumerate(samples):
        assert tokens == new_tokens[row, :len(tokens)].tolist()  # the same samples (same seed)
        np.testing.assert_allclose(logprobs, expected[row, :len(tokens)].numpy(), rtol=1e-5, atol=1e-5)
    assert watched.largest <= max(8, 4 * len(prompts)) * vocab < logits.numel()
