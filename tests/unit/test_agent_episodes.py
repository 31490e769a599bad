"""Agent episodes (operators/engines/agent_episodes.py, operators/environments/agents.py) without an engine: how an
episode's recorded calls become one sample (the chain of calls that extend each other, the group's shared
prompt, the length cut), what an agent may return, and what a config naming an agent is refused for."""

from __future__ import annotations

import pytest

from operators.engines.agent_episodes import AgentOutcome, assemble, chain_calls, shared_prefix
from operators.engines.openai_endpoint import RecordedCall
from operators.environments.agents import agent_problems, is_agent, resolve_agent, reward_of


def call(number: int, prompt: list[int], tokens: list[int], version: int = 0, episode: str = "e") -> RecordedCall:
    return RecordedCall(episode, number, "chat", prompt, tokens, [-0.5 - t / 100 for t in tokens],
                        [version] * len(tokens), f"text{number}", "stop")


def test_calls_that_resend_the_conversation_join_into_one_sequence_with_the_tokens_between_them_masked():
    first = call(0, [1, 2, 3], [10, 11, 99], version=4)
    second = call(1, [1, 2, 3, 10, 11, 99, 7, 8], [12, 13], version=5)  # 7, 8: the template and the user's turn
    chain, trained = chain_calls([first, second])
    assert trained == [True, True]
    assert chain.prompt_ids == [1, 2, 3]
    assert chain.tokens == [10, 11, 99, 7, 8, 12, 13]
    assert chain.mask == [1, 1, 1, 0, 0, 1, 1]
    assert chain.versions == [4, 4, 4, 4, 4, 5, 5]  # the tokens between take the version before them
    assert chain.logprobs[:3] == first.logprobs and chain.logprobs[5:] == second.logprobs
    assert chain.logprobs[3:5] == [0.0, 0.0]


def test_a_call_that_does_not_extend_the_last_one_starts_a_new_chain_and_only_the_last_chain_is_trained():
    first = call(0, [1, 2, 3], [10, 11])
    rewritten = call(1, [1, 2, 3, 10, 55, 7], [12])  # the template re-tokenised the reply: 55, not 11
    third = call(2, [1, 2, 3, 10, 55, 7, 12, 9], [14])
    chain, trained = chain_calls([first, rewritten, third])
    assert trained == [False, True, True]
    assert chain.prompt_ids == [1, 2, 3, 10, 55, 7] and chain.tokens == [12, 9, 14] and chain.mask == [1, 0, 1]


def test_the_responses_of_one_call_with_n_above_one_are_alternatives_not_a_sequence():
    one, other = call(0, [1, 2], [5]), call(0, [1, 2], [6])
    chain, trained = chain_calls([one, other])
    assert trained == [False, True] and chain.tokens == [6]
    assert chain_calls([]) == (None, [])


def test_the_group_continues_the_prompt_its_episodes_share_and_each_response_leads_with_the_rest_of_its_own():
    a = AgentOutcome([call(0, [1, 2, 3, 4], [10, 11], version=2)], 1.0, "done")
    b = AgentOutcome([call(0, [1, 2, 3, 5, 6], [12], version=3)], 0.0, "done")
    prompt, responses = assemble([1, 2, 3], [a, b], max_episode_tokens=8)
    assert prompt == [1, 2, 3] == shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5, 6]])
    (tokens_a, logprobs_a, versions_a, episode_a), (tokens_b, _, versions_b, episode_b) = responses
    assert tokens_a == [4, 10, 11] and episode_a.loss_mask == [0, 1, 1] and versions_a == [2, 2, 2]
    assert logprobs_a[0] == 0.0 and logprobs_a[1:] == a.calls[0].logprobs
    assert tokens_b == [5, 6, 12] and episode_b.loss_mask == [0, 0, 1] and versions_b == [3, 3, 3]
    assert (episode_a.reward, episode_a.end, episode_a.env_errors) == (1.0, "done", 0)
    assert [t["trained"] for t in episode_a.turns] == [True]


def test_a_response_is_cut_to_the_rows_prompt_plus_the_episode_budget():
    long = AgentOutcome([call(0, [1, 2, 3, 4, 5], [10, 11, 12, 13])], 1.0, "done")
    prompt, [(tokens, logprobs, versions, episode)] = assemble([1, 2], [long], max_episode_tokens=5)
    assert prompt == [1, 2, 3, 4, 5]  # one episode: its whole prompt is the group's
    assert tokens == [10, 11] and len(logprobs) == len(versions) == len(episode.loss_mask) == 2
    assert episode.end == "token_budget" and len(prompt) + len(tokens) == 2 + 5


def test_episodes_that_failed_keep_their_calls_count_as_errors_and_one_with_no_call_is_empty():
    raised = AgentOutcome([call(0, [1, 2], [10])], None, "env_error", "agent: KeyError: 'x'")
    silent = AgentOutcome([], 1.0, "done")
    late = AgentOutcome([], None, "timeout", "agent: ran past rollout.environment.timeout_s (1 s)")
    prompt, responses = assemble([1, 2], [raised, silent, late], max_episode_tokens=4)
    assert prompt == [1, 2]
    assert [r[0] for r in responses] == [[10], [], []]
    ends = [(r[3].end, r[3].env_errors, r[3].reward) for r in responses]
    assert ends == [("env_error", 1, 0.0), ("no_calls", 0, 1.0), ("timeout", 1, 0.0)]
    assert responses[0][3].turns[-1]["error"] == "agent: KeyError: 'x'"


def test_what_an_agent_returns_is_a_reward_or_none_and_anything_else_is_its_error():
    assert reward_of("a", 1) == 1.0 and reward_of("a", None) is None and reward_of("a", 0.25) == 0.25
    for bad in (True, "1", [1.0]):
        with pytest.raises(TypeError, match="return a number or None"):
            reward_of("agent:m:f", bad)
    with pytest.raises(ValueError, match="not a finite number"):
        reward_of("agent:m:f", float("nan"))


def test_an_agent_is_named_with_its_prefix_and_refused_with_the_fix():
    name = "agent:operators.environments.example_agents:add_by_completion"
    assert is_agent(name) and not is_agent("tools") and not is_agent("pkg.mod:Class")
    assert callable(resolve_agent(name)) and agent_problems(name, {"max_tokens": 4}) == []
    assert "unexpected keyword argument 'tokens'" in agent_problems(name, {"tokens": 4})[0]
    with pytest.raises(ValueError, match="'agent:package.module:function'"):
        resolve_agent("agent:only_a_module")
    with pytest.raises(ImportError, match="cannot import module 'no_such_module'"):
        resolve_agent("agent:no_such_module:f")
    with pytest.raises(TypeError, match="not a function"):
        resolve_agent("agent:operators.engines.agent_episodes:Chain")


def test_a_config_naming_an_agent_is_checked_before_anything_starts():
    from pipelines.config.base import ConfigError
    from pipelines.config.load import load_config

    base = ["rollout.engine=vllm", "data.path=builtin:arithmetic-train"]
    agent = "rollout.environment.name=agent:operators.environments.example_agents:add_by_completion"
    cfg = load_config(None, base + [agent, "rollout.environment.options.max_tokens=4", "reward.functions=[]"])
    assert cfg.rollout.environment.timeout_s == 300 and cfg.reward.functions == []
    for overrides, expected in (
            ([agent, "rollout.environment.options.tokens=4"], "unexpected keyword argument 'tokens'"),
            (["rollout.environment.name=agent:nowhere_module:f"], "cannot import module 'nowhere_module'"),
            (["rollout.environment.name=agent:operators.environments.example_agents:missing"],
             "has no attribute 'missing'")):
        with pytest.raises(ConfigError) as err:
            load_config(None, base + overrides)
        assert "rollout.environment" in str(err.value) and expected in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="reward.functions: empty, and no rollout.environment"):
        load_config(None, base + ["reward.functions=[]"])


def test_an_agent_cut_at_its_call_budget_ends_as_max_turns_not_as_an_error():
    cut = AgentOutcome([call(0, [1, 2], [10]), call(1, [1, 2, 10, 3], [11])], None, "max_turns")
    _, [(tokens, _, _, episode)] = assemble([1, 2], [cut], max_episode_tokens=8)
    assert tokens == [10, 3, 11] and (episode.end, episode.env_errors, episode.reward) == ("max_turns", 0, 0.0)
