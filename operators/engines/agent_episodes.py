"""Agent episodes on the in-flight rollout loop: a user's agent (operators/environments/agents.py) talks to the
rollout endpoint (operators/engines/openai_endpoint.py) through an OpenAI client, and its recorded calls become
one training sample per episode.

`AgentRunner.group` runs a prompt's `n` episodes, each the agent function once in a worker thread with its own
episode id (the endpoint refuses calls of an episode that is not running, and drops a call that outlives its
episode). When the episodes end, their calls are read back as the engine sampled them and joined by
`chain_calls`:

- An agent that sends the whole conversation again on each call (the usual chat loop) makes calls whose prompt
  starts with the previous call's prompt and sampled tokens: such calls join into one sequence, the tokens
  between them (the chat template's markup, the agent's next message, a tool's answer) carrying no loss, as an
  environment's observations do. Whether a call extends the last one is checked token by token, never assumed:
  a template that re-renders the sampled text differently (another tokenisation, a reasoning block dropped)
  breaks the chain there.
- Where the chain breaks (or a call samples n > 1 responses, which are alternatives, not a sequence), the
  episode's sample is its last chain, the one that ends with the agent's final call; the calls before it are
  recorded in the episode's turns with `trained: false`, not trained on.

A group's responses must continue one prompt (the trainer scores prompt + response): the group's prompt is
the longest prefix the episodes' prompts share, and what follows it in each episode's own prompt leads its
response, without loss. A response is cut to what the row allowed: the row's prompt plus
`max_episode_tokens`, less that prompt (every downstream length limit holds).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from operators.engines.base import GroupSample
from operators.engines.engine_slots import EngineSlots
from operators.engines.openai_endpoint import EpisodeRules, RecordedCall, RolloutEndpoint
from operators.engines.rollout_records import Episode, GroupResult

NO_LOSS_LOGPROB = 0.0  # a token the policy did not sample (mask 0): its log-prob is never read


@dataclass
class Chain:
    """Calls joined into one sequence: `prompt_ids`, then response tokens (sampled: mask 1; in between: 0)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # indices of the episode's calls in it

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add(self, tokens: list[int], versions: list[int], logprobs: list[float] | None) -> None:
        self.tokens += tokens
        self.versions += versions
        self.logprobs += list(logprobs) if logprobs is not None else [NO_LOSS_LOGPROB] * len(tokens)
        self.mask += [1 if logprobs is not None else 0] * len(tokens)


def extends(context: list[int], prompt: list[int]) -> bool:
    return len(prompt) >= len(context) and prompt[:len(context)] == context


def chain_calls(calls: list[RecordedCall]) -> tuple[Chain | None, list[bool]]:
    """The episode's last chain of calls (see the module's docstring) and, per call, whether it is in it."""
    chains: list[Chain] = []
    for index, call in enumerate(calls):
        current = chains[-1] if chains else None
        single = current is not None and calls[current.calls[-1]].call != call.call  # n > 1: alternatives
        if current is not None and single and extends(current.context, call.prompt_token_ids):
            between = call.prompt_token_ids[len(current.context):]
            current.add(between, [current.versions[-1] if current.versions else 0] * len(between), None)
        else:
            current = Chain(list(call.prompt_token_ids))
            chains.append(current)
        current.add(list(call.token_ids), list(call.versions), call.logprobs)
        current.calls.append(index)
    if not chains:
        return None, []
    kept = set(chains[-1].calls)
    return chains[-1], [index in kept for index in range(len(calls))]


def shared_prefix(sequences: list[list[int]]) -> list[int]:
    if not sequences:
        return []
    first, length = sequences[0], min(len(s) for s in sequences)
    for position in range(length):
        if any(s[position] != first[position] for s in sequences[1:]):
            return first[:position]
    return first[:length]


@dataclass
class AgentOutcome:
    """One episode as it ended: its calls, the agent's reward, and how it ended ("done", "timeout",
    "env_error") with the error's text."""

    calls: list[RecordedCall]
    reward: float | None
    end: str
    error: str | None = None


def assemble(row_prompt_ids: list[int], outcomes: list[AgentOutcome], max_episode_tokens: int):
    """The group's prompt and, per episode, (tokens, log-probs, versions, Episode) (the module's docstring)."""
    chains = [chain_calls(o.calls) for o in outcomes]
    prompts = [c.prompt_ids for c, _ in chains if c is not None]
    prompt = shared_prefix(prompts) or (prompts[0] if prompts else list(row_prompt_ids))
    budget = len(row_prompt_ids) + max_episode_tokens - len(prompt)
    responses = []
    for outcome, (chain, trained) in zip(outcomes, chains):
        turns = [{"text": c.text, "tokens": len(c.token_ids), "ended_by": c.finish_reason,
                  "version": min(c.versions) if c.versions else None, "route": c.route, "trained": t}
                 for c, t in zip(outcome.calls, trained)]
        episode = Episode([], turns, outcome.end if outcome.calls or outcome.end != "done" else "no_calls",
                          reward=outcome.reward or 0.0, env_errors=int(outcome.end in ("env_error", "timeout")))
        if outcome.error:
            turns.append({"text": "", "tokens": 0, "error": outcome.error})
        tokens, logprobs, versions = [], [], []
        if chain is not None and extends(prompt, chain.prompt_ids) and budget > 0:
            lead = chain.prompt_ids[len(prompt):]
            first = chain.versions[0] if chain.versions else 0
            tokens = lead + chain.tokens
            logprobs = [NO_LOSS_LOGPROB] * len(lead) + chain.logprobs
            versions = [first] * len(lead) + chain.versions
            episode.loss_mask = [0] * len(lead) + chain.mask
            if len(tokens) > budget:
                tokens, logprobs, versions = tokens[:budget], logprobs[:budget], versions[:budget]
                episode.loss_mask = episode.loss_mask[:budget]
                episode.end = "token_budget" if episode.end == "done" else episode.end
        elif chain is not None:
            turns.append({"text": "", "tokens": 0, "error": "not trained: its prompt does not start with the "
                          "group's" if budget > 0 else "not trained: the agent's prompt is longer than the row's "
                          "prompt plus rollout.environment.max_episode_tokens"})
        responses.append((tokens, logprobs, versions, episode))
    return prompt, responses


class AgentRunner:
    """Runs agent episodes against `endpoint` (see the module's docstring); its methods run on the rollout
    loop's event loop. `check_failure` raises the loop's failure, if it has one."""

    def __init__(self, endpoint: RolloutEndpoint, slots: EngineSlots, decode: Callable[[list[int]], str],
                 check_failure: Callable[[], None], workers: int = 64):
        self.endpoint, self.slots, self.decode, self.check_failure = endpoint, slots, decode, check_failure
        endpoint.open_episodes_only = True
        # an agent holds its thread for its whole episode, waiting on its calls (its time runs from its start)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(workers, slots.cap),
                                                              thread_name_prefix="rollout-agent")
        self._groups = itertools.count()

    async def group(self, row_prompt_ids: list[int], n: int, seed: int, agent, row: dict,
                    temperature: float, max_calls: int, max_episode_tokens: int) -> GroupResult:
        """`n` episodes of `agent` (an AgentRun) for one dataset row, as one group."""
        self.check_failure()
        start = time.time()
        # the episode id travels in an HTTP header: this actor's group counter, not the uid (a prompt's text)
        group = next(self._groups)
        outcomes = await asyncio.gather(*[
            self._episode(agent, row, f"agent-{group}.{index}",
                          EpisodeRules((seed + 7919 * index) % (2**31 - 1), temperature, max_calls))
            for index in range(n)])
        self.check_failure()  # a failed loop fails the group, not each episode as the agent's error
        end = time.time()
        prompt, responses = assemble(row_prompt_ids, outcomes, max_episode_tokens)
        sample = GroupSample([r[0] for r in responses], [r[1] for r in responses],
                             [self.decode(r[0]) for r in responses])
        return GroupResult(sample, [r[2] for r in responses], start, end, self.slots.paused_within(start, end),
                           episodes=[r[3] for r in responses], prompt_ids=prompt, version=self.slots.version)

    async def _episode(self, agent, row: dict, episode: str, rules: EpisodeRules) -> AgentOutcome:
        loop = asyncio.get_running_loop()
        async with self.slots.episode():  # without partial rollout, a swap waits for the episodes running
            self.endpoint.open_episode(episode, rules)
            reward, end, error = None, "done", None
            try:
                work = loop.run_in_executor(self.executor, agent.run, self.endpoint.base_url, self.endpoint.token,
                                            episode, row)
                reward = await asyncio.wait_for(work, agent.timeout_s)
            except asyncio.TimeoutError:
                end, error = "timeout", f"agent: ran past rollout.environment.timeout_s ({agent.timeout_s:g} s)"
            except Exception as err:  # noqa: BLE001 - an agent's failure ends its episode, not the job
                # past max_turns calls it is cut there, as an environment's episode; anything else is its error
                end, error = ("max_turns", None) if rules.over_budget else ("env_error",
                                                                            f"agent: {type(err).__name__}: {err}")
            return AgentOutcome(self.endpoint.close_episode(episode), reward, end, error)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
