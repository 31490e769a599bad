"""Operators on CPU with the tiny model: Reward contains failures, Generate's log-probs are
right, and the policy-store admission gate works with real Ray actors."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from operators.stages.generate import Generate
from operators.stages.reward import Reward


def group_batch(responses: list[list[str]], answers: list[str]) -> pd.DataFrame:
    return pd.DataFrame({
        "prompt_id": [f"p{i}" for i in range(len(answers))],
        "prompt": ["x"] * len(answers),
        "answer": answers,
        "responses": responses,
    })


def test_reward_contains_a_failing_function():
    batch = group_batch([["12", "17"], ["7", "abc"]], ["12", "7"])
    out = Reward([("reward_fixtures:flaky_length", 1.0), ("arithmetic_exact", 10.0)], on_error=-1.0)(batch)
    # flaky_length raises for texts containing '7' -> those samples get on_error=-1.0.
    # row 0: "12" -> len 2 + 10*1 = 12; "17" -> -1 + 10*0 = -1
    # row 1: "7" -> -1 + 10*1 = 9; "abc" -> 3 + 10*0 = 3
    assert out["rewards"].tolist() == [[12.0, -1.0], [9.0, 3.0]]
    assert out["reward_errors"].tolist() == [1, 1]
    assert out["reward_reward_fixtures.flaky_length"].tolist() == [[2.0, -1.0], [-1.0, 3.0]]
    assert out["answer"].tolist() == ["12", "7"]  # unknown columns pass through


def test_reward_none_and_named_columns_only():
    batch = group_batch([["3", ""]], ["3"])
    out = Reward([("reward_fixtures:none_for_empty", 1.0)], on_error=0.5)(batch)
    assert out["rewards"].tolist() == [[1.0, 0.5]]
    assert out["reward_errors"].tolist() == [1]


def test_reward_empty_batch():
    out = Reward()(group_batch([], []))
    assert len(out) == 0 and "rewards" in out.columns


@pytest.fixture(scope="module")
def generate(tiny_model_path):
    return Generate(tiny_model_path, n=4, max_new_tokens=4, seed=3)


def test_generate_groups_and_logprobs(generate, tiny_model_path):
    from transformers import AutoModelForCausalLM

    batch = pd.DataFrame({"prompt": ["3+4=", "9+9=", "0+1="], "prompt_id": ["a", "b", "c"]})
    out = next(generate(batch))
    assert out["prompt_id"].tolist() == ["a", "b", "c"]
    assert all(len(r) == 4 for r in out["responses"]) and (out["policy_version"] == 0).all()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True).eval()
    eos = generate.engine.eos_id
    for _, row in out.iterrows():
        for tokens, logprobs, text, length in zip(
            row["response_token_ids"], row["behavior_logprobs"], row["responses"], row["response_lengths"]
        ):
            assert len(tokens) == len(logprobs) == length and 1 <= length <= 4
            assert eos not in tokens[:-1]  # generation stops at the first EOS
            # The behaviour log-probs are those of a plain forward pass over prompt + response.
            ids = torch.tensor([list(row["prompt_token_ids"]) + list(tokens)])
            with torch.no_grad():
                logits = model(ids).logits[0, len(row["prompt_token_ids"]) - 1:-1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            np.testing.assert_allclose(logprobs, expected.numpy(), atol=1e-4)


def test_generate_is_reproducible(generate):
    batch = pd.DataFrame({"prompt": ["1+2=", "5+5="], "group_uid": ["u1", "u2"]})
    first, second = next(generate(batch)), next(generate(batch))
    assert first["response_token_ids"].tolist() == second["response_token_ids"].tolist()


def test_admission_gate_pulls_newer_weights(ray_cluster, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from pipelines.runtime.policy_store import create_policy_store

    store = create_policy_store("test-gate-store")
    try:
        generate = Generate(tiny_model_path, n=2, max_new_tokens=3, policy_store=store,
                            max_staleness=1, admission_timeout_s=2.0)
        row = pd.DataFrame({"prompt": ["2+2="], "group_uid": ["g"], "train_step": [2]})
        # Step 2 at staleness 1 needs version >= 1; the store only has 0: the gate must hold.
        with pytest.raises(Exception, match="Timeout"):
            next(generate(row))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True)
        new_weights = {k: (v * 0.5).numpy() for k, v in model.state_dict().items()}
        store.publish(1, ray_cluster.put(new_weights))
        out = next(generate(row))
        assert out["policy_version"].tolist() == [1]
        loaded = generate.engine.model.state_dict()
        for name, array in new_weights.items():
            np.testing.assert_array_equal(loaded[name].numpy(), array)
    finally:
        store.kill()
