"""A step's samples travel as numpy columns (operators/algorithms/columns.py): explode and shard give
arrays, not lists, a sample without a column still reads None, and what is built from them holds the
groups' values: the trainer's TokenBatch equals one built here sample by sample from the groups, and the
rollouts Parquet equals the one pandas writes from the groups' lists."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from operators.algorithms.batching import packed_inputs, token_batch
from operators.algorithms.columns import Ragged
from operators.algorithms.step_batch import explode, shard, split_critic_samples, step_normalisers, subset
from operators.stages.tables import rollouts_table, to_parquet


def mixed_groups() -> list[dict]:
    """A step mixing a multi-turn group (loss masks, reference log-probs), a single-turn one without either,
    and one with reference log-probs only; prompts and responses of different lengths."""
    rng = np.random.default_rng(0)
    rows = []
    for group, (size, masked, refs) in enumerate([(3, True, True), (2, False, False), (2, False, True)]):
        responses = [rng.integers(5, 50, size=int(length)).tolist() for length in rng.integers(1, 7, size=size)]
        row = {"prompt_token_ids": rng.integers(5, 50, size=2 + group).tolist(), "response_token_ids": responses,
               "behavior_logprobs": [(-rng.random(len(r))).tolist() for r in responses],
               "advantages": rng.normal(size=size).tolist(), "staleness": group}
        if masked:
            row["loss_masks"] = [[1] + rng.integers(0, 2, size=len(r) - 1).tolist() for r in responses]
        if refs:
            row["ref_logprobs"] = [(-rng.random(len(r))).tolist() for r in responses]
        rows.append(row)
    return rows


def per_sample(rows: list[dict]) -> list[dict]:
    """The groups' responses one by one, as plain lists (None where the group lacks the column)."""
    return [{"prompt": row["prompt_token_ids"], "response": response,
             "behavior_logprobs": row["behavior_logprobs"][index], "advantage": row["advantages"][index],
             "loss_mask": row["loss_masks"][index] if "loss_masks" in row else None,
             "ref_logprobs": row["ref_logprobs"][index] if "ref_logprobs" in row else None,
             "staleness": row["staleness"]}
            for row in rows for index, response in enumerate(row["response_token_ids"])]


def reference_batch(samples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The padded tensors token_batch promises, written out per sample and per token."""
    width = max(len(s["prompt"]) + len(s["response"]) for s in samples)
    rows = len(samples)
    out = {"input_ids": torch.full((rows, width), pad_id, dtype=torch.long),
           "attention": torch.zeros((rows, width), dtype=torch.long),
           **{name: torch.zeros((rows, width - 1)) for name in ("mask", "span", "behavior_logprobs", "advantages",
                                                                 "ref_logprobs")}}
    for row, sample in enumerate(samples):
        sequence = sample["prompt"] + sample["response"]
        for position, token in enumerate(sequence):
            out["input_ids"][row, position], out["attention"][row, position] = token, 1
        for index in range(len(sample["response"])):
            at = len(sample["prompt"]) - 1 + index  # the position that predicts response token `index`
            out["span"][row, at] = 1.0
            out["mask"][row, at] = 1.0 if sample["loss_mask"] is None else float(sample["loss_mask"][index])
            out["behavior_logprobs"][row, at] = sample["behavior_logprobs"][index]
            out["advantages"][row, at] = sample["advantage"]
            if sample["ref_logprobs"] is not None:
                out["ref_logprobs"][row, at] = sample["ref_logprobs"][index]
    return out


def assert_batch_equals(batch, expected: dict, refs: bool) -> None:
    for name in ("input_ids", "attention", "mask", "behavior_logprobs", "advantages"):
        assert torch.equal(getattr(batch, name), expected[name]), name
    assert torch.equal(batch.mask if batch.span is None else batch.span, expected["span"])  # None: the mask
    assert batch.mask.dtype == torch.float32 and batch.input_ids.dtype == torch.long
    if refs:
        assert torch.equal(batch.ref_logprobs, expected["ref_logprobs"])
    else:
        assert batch.ref_logprobs is None


def test_explode_and_shard_give_numpy_columns_that_still_read_like_lists():
    rows = mixed_groups()
    samples = explode(rows)
    expected = per_sample(rows)
    for name in ("prompt_token_ids", "response_token_ids", "behavior_logprobs", "loss_masks", "ref_logprobs"):
        assert isinstance(samples[name], Ragged) and len(samples[name]) == len(expected), name
    assert samples["response_token_ids"].values.dtype == np.int64
    assert samples["behavior_logprobs"].values.dtype == np.float64
    for name, dtype in (("advantages", np.float64), ("staleness", np.int64)):  # one per response
        assert isinstance(samples[name], np.ndarray) and samples[name].dtype == dtype, name
    for index, sample in enumerate(expected):
        assert isinstance(samples["response_token_ids"][index], np.ndarray)
        assert samples["response_token_ids"][index].tolist() == sample["response"]
        assert samples["prompt_token_ids"][index].tolist() == sample["prompt"]
        assert samples["advantages"][index] == sample["advantage"]
        assert samples["staleness"][index] == sample["staleness"]
        for name, key in (("loss_masks", "loss_mask"), ("ref_logprobs", "ref_logprobs")):
            if sample[key] is None:
                assert samples[name][index] is None, (name, index)  # the group lacks it: still None
            else:
                assert samples[name][index].tolist() == sample[key], (name, index)
    # the step's normalisers: a masked response counts its 1s, an unmasked one all its tokens
    counts = [sum(s["loss_mask"]) if s["loss_mask"] is not None else len(s["response"]) for s in expected]
    assert step_normalisers(samples) == (sum(counts), sum(1 for count in counts if count))

    shards = shard(samples, 2)
    assert sum(len(part["advantages"]) for part in shards) == len(expected)
    for part in shards:
        for name, column in part.items():
            assert isinstance(column, (Ragged, np.ndarray)) and not isinstance(column, list), name
        copy = pickle.loads(pickle.dumps(part, protocol=5))  # what Ray sends a rank
        for name in part:
            if isinstance(part[name], Ragged):
                assert copy[name] == part[name], name
            else:
                np.testing.assert_array_equal(copy[name], part[name], err_msg=name)


def test_token_batch_of_the_columns_equals_one_built_sample_by_sample():
    """Padded and packed, for the whole step, a shard of it, and a subset whose every sample has reference
    log-probs (then they are in the batch); also from the same samples given as plain lists."""
    rows = mixed_groups()
    samples, expected = explode(rows), per_sample(rows)
    required, optional = ("behavior_logprobs", "advantages"), ("ref_logprobs",)
    assert_batch_equals(token_batch(samples, 0, required, optional), reference_batch(expected), refs=False)
    with_refs = [index for index, sample in enumerate(expected) if sample["ref_logprobs"] is not None]
    for indices, refs in (([6, 0, 3], False), (with_refs, True), ([4], False)):
        batch = token_batch(subset(samples, indices), 0, required, optional, packed=True)
        reference = reference_batch([expected[i] for i in indices])
        assert_batch_equals(batch, reference, refs)
        sequences = [expected[i]["prompt"] + expected[i]["response"] for i in indices]
        packed = packed_inputs(sequences)
        for name in ("input_ids", "position_ids", "index", "valid"):
            assert torch.equal(getattr(batch.packed, name), getattr(packed, name)), name
    as_lists = {name: column.tolist() if isinstance(column, (Ragged, np.ndarray)) else column
                for name, column in samples.items()}
    assert_batch_equals(token_batch(as_lists, 0, required, optional), reference_batch(expected), refs=False)


def test_token_batch_of_the_columns_keeps_its_errors_and_overflow():
    rows = mixed_groups()
    rows[0]["behavior_logprobs"][1] = rows[0]["behavior_logprobs"][1][:-1]  # one value short
    rows[0]["advantages"] = [[1e39] * len(r) for r in rows[0]["response_token_ids"]]  # per token: GAE's shape
    samples = explode(rows)
    assert isinstance(samples["advantages"], Ragged)  # a float of another group is spread over its tokens
    length = len(rows[0]["response_token_ids"][1])
    with pytest.raises(ValueError, match=f"sample 1: {length - 1} behavior_logprobs for {length} response tokens"):
        token_batch(samples, 0, ("behavior_logprobs", "advantages"))
    batch = token_batch(samples, 0, ("advantages",))
    assert torch.isinf(batch.at_response(batch.advantages, 0)).all()  # float32 overflow reaches the NaN guard
    expected = per_sample(mixed_groups())
    assert batch.at_response(batch.advantages, 5).tolist() == pytest.approx([expected[5]["advantage"]] *
                                                                            len(expected[5]["response"]))


def critic_groups(token_versions: bool) -> list[dict]:
    """A multi-turn PPO step as the Train operator logs it: per-token advantages, values, returns, loss
    masks; the lineage columns; with `token_versions`, the version of every token (partial rollout)."""
    rng = np.random.default_rng(1)
    rows = []
    for group in range(3):
        responses = [rng.integers(5, 50, size=int(length)).tolist() for length in rng.integers(1, 6, size=2)]
        token_floats = lambda: [rng.normal(size=len(r)).tolist() for r in responses]  # noqa: E731
        row = {"prompt_id": f"p{group}", "group_uid": f"g{group}", "epoch": 0, "policy_version": 4 - group,
               "prompt": f"question {group}", "responses": ["a", "b"], "response_token_ids": responses,
               "response_lengths": [len(r) for r in responses], "rewards": [1.0, 0.0],
               "behavior_logprobs": token_floats(), "advantages": token_floats(), "values": token_floats(),
               "returns": token_floats(), "critic_version": 2, "reward_errors": 0, "reward_timeouts": 0,
               "prompt_token_ids": [1, 2, 3], "generator_id": "h:1",
               "loss_masks": [rng.integers(0, 2, size=len(r)).tolist() for r in responses],
               "turns": ["[]", "[]"], "num_turns": [1, 2], "episode_ends": ["eos", "max_turns"],
               "env_rewards": [1.0, 0.0], "tool_calls": 1, "tool_errors": 0, "env_errors": 0}
        if token_versions:
            row["token_policy_versions"] = [[4 - group] * len(r) for r in responses]
        rows.append(row)
    if not token_versions:
        for row in rows:
            row["advantages"] = [float(rng.normal()) for _ in row["response_token_ids"]]  # one per response
    return rows


@pytest.mark.parametrize("token_versions", [True, False])
def test_the_rollouts_parquet_holds_the_groups_values(token_versions):
    rows = critic_groups(token_versions)
    step = rollouts_table(rows, 4, {"g1": "surplus"})
    logged = pd.read_parquet(io.BytesIO(step.to_parquet()))
    assert logged["used"].tolist() == [True, False, True] and logged["train_step"].tolist() == [4] * 3
    for column in ("response_token_ids", "advantages", "values", "returns", "loss_masks"):
        for cell, row in zip(logged[column], rows):
            assert [np.asarray(response).tolist() for response in cell] == row[column], column
    versions = [[[row["policy_version"]] * len(r) for r in row["response_token_ids"]] for row in rows]
    assert [[response.tolist() for response in cell] for cell in logged["token_policy_versions"]] == versions
    # the same file (types, values, pandas metadata) as pandas writes from the groups' Python lists
    lists = step.groups.copy()
    for column in ("response_token_ids", "advantages", "values", "returns", "loss_masks"):
        lists[column] = pd.Series([row[column] for row in rows], index=lists.index, dtype=object)
    lists["token_policy_versions"] = pd.Series(versions, index=lists.index, dtype=object)
    written, expected = (pq.read_table(io.BytesIO(data)) for data in (step.to_parquet(), to_parquet(lists)))
    assert written.schema.equals(expected.schema, check_metadata=True), (written.schema, expected.schema)
    assert written.equals(expected)
    # the table the ledger and the metrics read carries the same numbers
    assert [[m.tolist() for m in cell] for cell in step.groups["loss_masks"]] == [row["loss_masks"] for row in rows]


def test_the_critics_samples_keep_their_columns():
    rows = critic_groups(token_versions=True)
    samples = explode(rows)
    critic = split_critic_samples(samples)
    assert "returns" not in samples and critic["loss_masks"] is samples["loss_masks"]
    assert isinstance(critic["returns"], Ragged) and critic["critic_version"].tolist() == [2] * 6
    assert critic["old_values"].tolist() == [values for row in rows for values in row["values"]]
