"""Shared-prompt packing (operators/algorithms/shared_prompts.py, train.share_prompts): units of one prompt and
its responses, the 4D mask that keeps each response to its prompt, the way back to the padded layout, and that
the tiny model's log-probs and gradients are each sequence's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from operators.algorithms.batching import token_batch
from operators.algorithms.shared_prompts import (
    shared_chunks,
    shared_prompt_inputs,
    shared_units,
    step_width_limit,
    unit_width_limit,
)


def test_units_group_equal_prompts_and_are_cut_at_the_width_limit():
    prompts = [[1, 2], [3], [1, 2], [1, 2], [3]]
    # prompt [1 2] with responses of 3, 2, 4 tokens; prompt [3] with 1 and 5
    lengths = [3, 1, 2, 4, 5]
    assert shared_units(prompts, lengths, 100) == [[0, 2, 3], [1, 4]]
    # at 8 tokens: [1 2] + 3 + 2 = 7, the next (4) opens a unit with its own copy of the prompt
    assert shared_units(prompts, lengths, 8) == [[0, 2], [3], [1, 4]]
    assert shared_units(prompts, lengths, 1) == [[0], [2], [3], [1], [4]]  # at least one sample per unit
    assert unit_width_limit(10) == 40 and unit_width_limit(10, 25) == 25 and unit_width_limit(10, 4) == 10


def test_the_layout_the_mask_and_the_pairs_that_read_each_response_token():
    shared = shared_prompt_inputs([[5, 6], [5, 6], [9]], [[7, 8], [4], [3]], pad_id=0)
    # unit [5 6 | 7 8 | 4] (5 tokens) and unit [9 | 3] (2 tokens) in rows of 5, first-fit longest first
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 4], [9, 3, 0, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 1, 2]]  # each response goes on from 2
    mask = shared.attention_mask[:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],
                       [1, 1, 1, 1, 0],
                       [1, 1, 0, 0, 1]]  # the second response sees the prompt and itself, not 7 8
    assert mask[1] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]
    # 7 after the prompt's last (position 1), 8 after 7 (2), 4 after the prompt's last again (1); 3 after 9 (row 1)
    assert shared.source.tolist() == [1, 2, 1, 5] and shared.target.tolist() == [7, 8, 4, 3]
    # padded [3, L-1 = 3]: sample 0 predicts at t = 1, 2; sample 1 at t = 1; sample 2 at t = 0
    assert shared.shape == (3, 3) and shared.dest.tolist() == [1, 2, 4, 6]
    values = torch.tensor([[10.0, 20.0, 30.0, 40.0]], requires_grad=True)
    scattered = shared.scatter(values)
    assert scattered.tolist() == [[0, 10, 20], [0, 30, 0], [40, 0, 0]]
    scattered.sum().backward()
    assert values.grad.tolist() == [[1, 1, 1, 1]]


def test_chunks_keep_a_group_together_within_the_budget():
    prompts = [[1, 2, 3]] * 4 + [[4, 5, 6]] * 4
    lengths = [2, 2, 2, 2, 1, 1, 1, 1]
    # units of 11 and 7 tokens: both fit one micro-batch of 22 slots (two rows of 11)
    assert shared_chunks(prompts, lengths, 22) == [list(range(8))]
    # 12 slots: each unit a micro-batch of its own, the narrower first
    assert shared_chunks(prompts, lengths, 12) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert shared_chunks(prompts, lengths, 0) == [list(range(8))]


def test_a_micro_batch_is_laid_out_in_the_units_its_chunk_was_planned_with():
    """The chunker cuts units at the step's limit (its longest sequence: 31 tokens, so 40 within the budget); a
    micro-batch of short sequences only, laid out at its own limit (4 x 5 tokens), would cut the group of 8 into
    two units, each with a copy of the prompt, in two rows of 20: 40 token slots where the chunk planned 26."""
    prompts = [[1, 2]] * 8 + [[9]]
    responses = [[3, 4, 5]] * 8 + [list(range(30))]
    budget = 40
    chunks = shared_chunks(prompts, [len(r) for r in responses], budget)
    assert chunks == [list(range(8)), [8]]  # the group (26 tokens) and the long one (31) do not share 2 x 31 slots
    limit = step_width_limit(prompts, [len(r) for r in responses], budget)
    assert limit == 40
    group = chunks[0]
    laid = shared_prompt_inputs([prompts[i] for i in group], [responses[i] for i in group], budget=budget,
                                width_limit=limit)
    assert laid.input_ids.shape == (1, 26) and laid.input_ids[0, :2].tolist() == [1, 2]
    assert int((laid.input_ids == 1).sum()) == 1  # the prompt once
    own = shared_prompt_inputs([prompts[i] for i in group], [responses[i] for i in group], budget=budget)
    assert own.input_ids.shape == (2, 20) and int((own.input_ids == 1).sum()) == 2  # the cut the limit avoids
    samples = {"prompt_token_ids": [prompts[i] for i in group], "response_token_ids": [responses[i] for i in group],
               "advantages": [1.0] * 8}
    batch = token_batch(samples, 0, ("advantages",), share_prompts=True, packed=True, budget=budget, width_limit=limit)
    assert batch.shared.input_ids.shape == (1, 26)


def _model(path: str, kernel: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32,
                                                attn_implementation=kernel).eval()


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_shared_log_probs_and_gradients_are_each_sequences_own(tiny_model_path, kernel):
    """Two groups of three responses (one response empty) under SDPA (a bool mask) and eager attention (an
    additive one): every response token's log-prob equals its sequence's own padded forward, and so do the
    gradients of a loss on them. The control: the same rows with a plain causal mask let a response read its
    group-mates and differ."""
    from operators.algorithms.losses import token_logprobs

    model = _model(tiny_model_path, kernel)
    generator = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()

    prompts, responses = [], []
    for prompt in (ids(4), ids(3)):
        for n in (3, 1, 5):
            prompts.append(prompt)
            responses.append(ids(n))
    samples = {"prompt_token_ids": prompts, "response_token_ids": responses,
               "behavior_logprobs": [[-1.0] * len(r) for r in responses], "advantages": [0.0] * len(responses)}
    padded = token_batch(samples, 0, ("behavior_logprobs", "advantages"))
    shared = token_batch(samples, 0, ("behavior_logprobs", "advantages"), share_prompts=True)
    assert shared.shared.input_ids.numel() < sum(len(p) + len(r) for p, r in zip(prompts, responses))
    if kernel == "eager":
        shared.shared = shared.shared.additive(torch.float32)
    weights = torch.linspace(0.5, 1.5, padded.mask.numel()).reshape(padded.mask.shape) * padded.mask

    def run(batch):
        model.zero_grad()
        logits = batch.outputs(model(**batch.model_inputs()).logits).float()
        logprobs = batch.unpack(token_logprobs(logits, batch.targets()))  # [B, L-1]
        (logprobs * weights).sum().backward()
        return logprobs.detach() * padded.mask, [p.grad.clone() for p in model.parameters()]

    expected, expected_grads = run(padded)
    got, grads = run(shared)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):  # float reassociation: the prompt's gradient is summed at once
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    # the control: no mask, so each response attends to the ones laid before it in its unit
    shared.shared.attention_mask = None
    leaked, _ = run(shared)
    assert not torch.allclose(leaked, expected, atol=1e-3)


def test_the_config_refuses_shared_prompts_without_packing():
    from pipelines.config.load import load_config

    with pytest.raises(Exception, match="train.share_prompts .* needs train.packing: true"):
        load_config(None, ["train.share_prompts=true", "train.packing=false"])
    assert load_config(None, ["train.share_prompts=true"]).train.share_prompts
