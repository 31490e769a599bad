"""Packed micro-batches (operators/algorithms/batching.py): how sequences are cut into packs and laid out
in rows, the way back to the padded layout, and that a packed forward of the tiny model gives each
sequence exactly what it gets alone: no token attends across a sequence boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from operators.algorithms.batching import packed_inputs, token_batch
from operators.algorithms.chunking import length_sorted_chunks, packed_chunks, padded_peak


def test_packed_chunks_keep_rows_x_width_within_the_budget_and_carry_more_tokens():
    lengths = [5, 1, 3, 9, 2, 4]
    packs = packed_chunks(lengths, 10)
    assert sorted(i for pack in packs for i in pack) == list(range(6))  # every sequence once
    # 9 alone (a second row of 9 would pass the budget); 5 | 4+1 in two rows of 5; 3 | 2. Indices ascending,
    # micro-batches narrowest first.
    assert packs == [[2, 4], [0, 1, 5], [3]]
    for pack in packs:  # the rows packed_inputs lays out stay within the budget
        rows = packed_inputs([[7] * lengths[i] for i in pack])
        assert rows.input_ids.numel() <= 10
    # long-tailed lengths: padded chunks of the same budget need more passes (each pads to its longest)
    tailed = [2, 3, 2, 4, 30, 3, 2, 2, 5, 3]
    assert packed_chunks(tailed, 32) == [[0, 1, 2, 3, 5, 6, 7, 8, 9], [4]]  # rows 5 | 4 | 3+2 | 3+2 | 3+2 | 2
    assert len(length_sorted_chunks(tailed, 32)) == 3
    assert packed_chunks([12, 3], 10) == [[1], [0]]  # longer than the budget: a micro-batch of its own
    assert packed_chunks([4, 2, 7], 0) == [[0, 1, 2]]  # 0: one micro-batch, arrival order
    assert packed_chunks([], 10) == [] and packed_chunks([], 0) == []


def test_packing_never_holds_more_token_slots_than_the_largest_padded_chunk():
    # the capped 8 stands alone in the padded path (5 x 3 fills a chunk), so the padded peak is 15 slots;
    # a packed micro-batch may not reach 16 by putting a second row of 8 beside it
    lengths = [8, 3, 3, 3, 3, 3]
    assert padded_peak(lengths, 16) == 15
    assert packed_chunks(lengths, 16) == [[1, 2, 3, 4, 5], [0]]  # five rows of 3; 8 alone
    rng = np.random.default_rng(0)
    for _ in range(200):  # long-tailed lengths with a cap, as responses are
        lengths = np.minimum(rng.lognormal(2.5, 1.0, rng.integers(1, 64)).astype(int) + 1, 256).tolist()
        budget = int(rng.choice([256, 512, 1024]))
        packs = packed_chunks(lengths, budget)
        assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
        slots = max(packed_inputs([[7] * lengths[i] for i in pack]).input_ids.numel() for pack in packs)
        assert slots <= padded_peak(lengths, budget) <= max(budget, max(lengths))


def test_packed_inputs_lay_sequences_in_rows_as_wide_as_the_longest():
    packed = packed_inputs([[5, 6, 7], [8], [9, 10]], pad_id=0)
    # rows of width 3, filled longest first: [5 6 7] and [9 10 | 8]; positions restart at each sequence
    assert packed.input_ids.tolist() == [[5, 6, 7], [9, 10, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    # padded (row, t) -> flat position of the packed [P, W-1] outputs; t < length - 1 only
    assert packed.valid.tolist() == [[True, True], [False, False], [True, False]]
    assert packed.index[packed.valid].tolist() == [0, 1, 2]
    tail = packed_inputs([[5, 6, 7, 8], [1, 2]], pad_id=99)
    assert tail.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 99, 99]]  # a row's unused tail: pad_id ...
    assert tail.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]  # ... with positions of its own
    one = packed_inputs([[5, 6, 7], [8], [9, 10]], one_row=True)  # flash-attention's layout
    assert one.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]] and one.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert one.index[one.valid].tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="no empty one"):
        packed_inputs([[1, 2], []])


def test_unpack_is_a_gather_with_zeros_at_the_padding_and_gradients_to_the_packed_positions():
    packed = packed_inputs([[5, 6, 7], [8], [9, 10]])
    values = torch.arange(1.0, 5.0).reshape(2, 2).requires_grad_()  # [P, W-1]
    unpacked = packed.unpack(values)  # [B, L-1]
    assert unpacked.tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]
    unpacked.sum().backward()
    assert values.grad.tolist() == [[1.0, 1.0], [1.0, 0.0]]  # the position between sequences 2 and 1 is not read


def test_a_packed_batch_keeps_the_padded_columns_and_runs_the_model_packed(tiny_model_path):
    samples = {"prompt_token_ids": [[1, 2], [3]], "response_token_ids": [[4, 5, 6], [7]],
               "behavior_logprobs": [[-1.0, -2.0, -3.0], [-4.0]], "advantages": [1.0, -1.0]}
    padded = token_batch(samples, 0, ("behavior_logprobs", "advantages"))
    packed = token_batch(samples, 0, ("behavior_logprobs", "advantages"), packed=True)
    for name in ("input_ids", "attention", "mask", "behavior_logprobs", "advantages"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name
    assert padded.model_inputs().keys() == {"input_ids", "attention_mask"}
    inputs = packed.model_inputs()
    assert inputs["attention_mask"] is None and inputs["use_cache"] is False
    assert inputs["input_ids"].tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]  # two rows of 5, no row for padding
    assert packed.targets().shape == (2, 4) and padded.targets().shape == (2, 4)


def test_packed_forward_equals_each_sequence_alone_and_needs_the_restarting_positions(tiny_model_path):
    """The tiny model's log-probs of sequences packed in rows equal each sequence's own forward; with
    positions that do not restart (one long sequence), tokens would attend across boundaries and differ."""
    from transformers import AutoModelForCausalLM

    from operators.algorithms.losses import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (9, 3, 5, 2, 6)]
    alone = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            alone.append(token_logprobs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])[0])
        for one_row in (False, True):
            packed = packed_inputs(sequences, one_row=one_row)
            assert packed.input_ids.shape[0] == (1 if one_row else 3)  # 9 | 3+5 | 6+2
            logits = model(**packed.model_inputs()).logits[:, :-1].float()
            unpacked = packed.unpack(token_logprobs(logits, packed.input_ids[:, 1:]))  # [B, L-1]
            for row, expected in enumerate(alone):
                torch.testing.assert_close(unpacked[row, :len(expected)], expected, rtol=1e-5, atol=1e-5)
        # the control: the same row without restarting positions reads across sequences
        packed = packed_inputs(sequences, one_row=True)
        continuous = torch.arange(packed.input_ids.shape[1])[None]
        logits = model(input_ids=packed.input_ids, position_ids=continuous, attention_mask=None,
                       use_cache=False).logits[:, :-1].float()
        unpacked = packed.unpack(token_logprobs(logits, packed.input_ids[:, 1:]))
        assert not torch.allclose(unpacked[1, :2], alone[1], atol=1e-3)
