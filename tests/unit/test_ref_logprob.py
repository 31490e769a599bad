"""The RefLogprob operator: its log-probs are the engine's for the same weights, chunking changes
nothing, and it runs as the DAG's ref_logprob stage."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from operators.generate import Generate
from operators.algorithms.batching import length_sorted_chunks
from operators.ref_logprob import RefLogprob
from pipelines.config.schema import ConfigError
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


def test_reference_config_is_checked_up_front(tmp_path):
    assert load_config(None, ["reference.num_actors=2"]).reference.model_path is None  # the starting policy
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"reference.model_path={tmp_path / 'missing'}"])
    assert "does not exist" in dict(err.value.problems)["reference.model_path"]
