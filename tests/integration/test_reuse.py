"""Generate and Reward in a plain Ray Data batch job: read -> generate -> score -> write."""

from __future__ import annotations

import pandas as pd

from operators.stages.reward import arithmetic_exact
from pipelines.score import score_prompts
from pipelines.data.tiny import make_arithmetic_dataset


def test_batch_inference_and_scoring(ray_cluster, tiny_model_path, tmp_path):
    prompts = make_arithmetic_dataset(24, seed=5)
    prompts.to_parquet(tmp_path / "prompts.parquet")
    score_prompts(str(tmp_path / "prompts.parquet"), str(tmp_path / "scored"), tiny_model_path, n=3, batch_size=8)
    scored = pd.read_parquet(tmp_path / "scored").sort_values("prompt_id").reset_index(drop=True)
    assert scored["prompt_id"].tolist() == sorted(prompts["prompt_id"])  # every prompt, once
    assert (scored["policy_version"] == 0).all()  # no policy store: the folder's weights
    for _, row in scored.iterrows():
        responses = list(row["responses"])
        assert len(responses) == 3 and len(row["behavior_logprobs"]) == 3
        # The stored rewards are the reward function applied to the stored responses.
        assert list(row["rewards"]) == arithmetic_exact(responses, [row["answer"]] * 3)
    assert 0 < sum(sum(r) for r in scored["rewards"]) < 72  # the warmed-up model is right sometimes
