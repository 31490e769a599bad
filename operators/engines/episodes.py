"""Multi-turn episodes on the in-flight rollout loop: the model's turns alternate with an environment's
answers (operators/environments/environment.py), every turn a request of its own to the engine.

`EpisodeRunner` is the rollout loop's (operators/engines/rollout.py) episode client: the loop makes one and
hands it what it shares, explicitly: the engine, the engine's slots (operators/engines/engine_slots.py:
the cap, the version per token, the pause log, the episodes running), the thread pool environments run
in and the loop's failure check. An environment's `reset` and `step` run in that thread pool, so a slow
tool never holds the event loop. Every method runs on the rollout loop's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from typing import Callable

from operators.engines.base import GroupSample, InFlightEngine, SamplingParams
from operators.engines.engine_slots import EngineSlots
from operators.engines.rollout_records import Episode, GroupResult
from operators.environments.environment import Turn, env_step_problem


def stopped(text: str, stop: tuple[str, ...], inside: bool) -> bool:
    """Whether `text` (a turn so far, one token longer than at the last check) completes a stop string: it ends
    with one, or with `inside` it holds one (checked every token, so the first completion is the newest)."""
    return any((s in text) if inside else text.endswith(s) for s in stop)


class EnvOutputError(ValueError):
    """An environment answered a turn with something that is not a valid EnvStep (env_step_problem)."""


class EpisodeRunner:
    """Runs multi-turn episodes on an in-flight engine (see the module's docstring)."""

    def __init__(self, engine: InFlightEngine, slots: EngineSlots, env_executor: concurrent.futures.Executor,
                 check_failure: Callable[[], None]):
        self.engine, self.slots, self.env_executor = engine, slots, env_executor
        self.check_failure = check_failure  # raises the rollout loop's failure, if it has one

    async def group(self, prompt_ids: list[int], params: SamplingParams, seed: int, uid: str, make_env,
                    row: dict, max_turns: int, max_tokens: int) -> GroupResult:
        """`params.n` episodes of one prompt (`make_env()` makes each one's environment, reset with the
        prompt's `row`). A turn is one request of at most `params.max_new_tokens` tokens; an episode has at
        most `max_turns` turns and `max_tokens` tokens after its prompt (observations included)."""
        self.check_failure()
        start = time.time()
        one = SamplingParams(**{**params.__dict__, "n": 1})
        request_id = self.slots.request_id(uid)
        episodes = await asyncio.gather(*[
            self._episode(prompt_ids, one, (seed + index) % (2**31 - 1), f"{request_id}.{index}", make_env, row,
                          max_turns, max_tokens) for index in range(params.n)])
        end = time.time()
        paused = self.slots.paused_within(start, end)
        # texts: the whole transcript after the prompt (the policy's turns and the observations)
        sample = GroupSample([e[0] for e in episodes], [e[1] for e in episodes],
                             [self.engine.decode(e[0]) for e in episodes])
        return GroupResult(sample, [e[2] for e in episodes], start, end, paused, episodes=[e[3] for e in episodes])

    async def _episode(self, prompt_ids: list[int], params: SamplingParams, seed: int, request_id: str, make_env,
                       row: dict, max_turns: int, max_tokens: int):
        """One episode: (response tokens, their log-probs, their versions, Episode). Observation tokens get
        log-prob 0.0 and the version of the turn before them; they are masked out of the loss."""
        async with self.slots.episode():  # without partial rollout, a swap that waits for episodes holds new ones
            return await self._play(prompt_ids, params, seed, request_id, make_env, row, max_turns, max_tokens)

    async def _play(self, prompt_ids: list[int], params: SamplingParams, seed: int, request_id: str, make_env,
                    row: dict, max_turns: int, max_tokens: int):
        loop = asyncio.get_running_loop()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        turns: list[dict] = []
        episode = Episode(mask, turns, "max_turns")
        try:
            env = make_env()
            await loop.run_in_executor(self.env_executor, env.reset, row)
        except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, not the job
            episode.turns.append({"text": "", "tokens": 0, "error": f"environment reset: {type(err).__name__}: {err}"})
            episode.env_errors, episode.end = 1, "env_error"
            return tokens, logprobs, versions, episode
        stop = tuple(getattr(env, "stop", ()) or ())
        for index in range(max_turns):
            budget = max_tokens - len(tokens)
            if budget <= 0:
                episode.end = "token_budget"
                break
            turn_params = SamplingParams(**{**params.__dict__, "max_new_tokens": min(params.max_new_tokens, budget)})
            turn_seed = (seed + 1_000_003 * index) % (2**31 - 1)
            ids, lps, vers, ended_by = await self.turn(prompt_ids + tokens, turn_params, turn_seed,
                                                        f"{request_id}.t{index}", stop)
            history = self.engine.decode(tokens)
            tokens += ids
            logprobs += lps
            versions += vers
            mask += [1] * len(ids)
            text = self.engine.decode(ids)
            record = {"text": text, "tokens": len(ids), "ended_by": ended_by,
                      "version": min(vers) if vers else self.slots.version}
            turns.append(record)
            try:
                result = await loop.run_in_executor(self.env_executor, env.step,
                                                    Turn(index, text, list(ids), ended_by, history))
                problem = env_step_problem(result)  # a wrong answer (a NaN reward, say) is the environment's error
                if problem:
                    raise EnvOutputError(problem)
            except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, not the job
                record["error"] = f"environment: {type(err).__name__}: {err}"
                episode.env_errors += 1
                episode.end = "env_error"
                break
            record.update(tool_call=result.tool_call, reward=result.reward, error=result.error)
            if result.reward is not None:
                episode.reward += float(result.reward)
            if result.tool_call is not None:
                episode.tool_calls += 1
                episode.tool_errors += result.error is not None
            if result.done or ended_by == "eos":
                episode.end = "done" if result.done else "eos"
                break
            observation = self.engine.encode_text(result.observation) if result.observation else []
            if index + 1 < max_turns:  # an observation no turn reads is not appended (nor recorded)
                record["observation"] = result.observation
                room = max_tokens - len(tokens)
                if len(observation) >= room:  # no room left for a turn after it
                    observation = observation[:room]
                    episode.end = "token_budget"
                tokens += observation
                logprobs += [0.0] * len(observation)
                versions += [record["version"]] * len(observation)
                mask += [0] * len(observation)
                if episode.end == "token_budget":
                    break
        return tokens, logprobs, versions, episode

    async def turn(self, context: list[int], params: SamplingParams, seed: int, request_id: str,
                   stop: tuple[str, ...], stop_inside: bool = False) -> tuple[list[int], list[float], list[int], str]:
        """One model turn (also the OpenAI endpoint's call with stop strings, operators/engines/openai_endpoint.py):
        (tokens, log-probs, versions, how it ended: "eos", "stop" or "length"). A stop string ends it at the
        token that completes it (the request is aborted there): the text ends with it, or with
        `stop_inside` (the endpoint's rule) the token's text holds it with more after it."""
        await self.slots.acquire(1)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ended_by = "length"
        stops = set(getattr(self.engine, "stop_ids", None) or (getattr(self.engine, "eos_id", None),))
        try:
            stream = self.engine.stream(context, params, seed, request_id, f"policy-v{self.slots.version}")
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    version = self.slots.received(len(delta.token_ids))
                    version = version if delta.version is None else delta.version  # an adapter: the request's
                    for token, logprob in zip(delta.token_ids, delta.logprobs):
                        tokens.append(token)
                        logprobs.append(logprob)
                        versions.append(version)
                        if token in stops:
                            ended_by = "eos"
                            break
                        if stop and stopped(self.engine.decode(tokens), stop, stop_inside):
                            ended_by = "stop"
                            break
                    if ended_by != "length":
                        break
                    if delta.finished:
                        break
            if ended_by == "stop":
                await self.engine.abort(request_id)
        finally:
            await self.slots.release(1)
        return tokens, logprobs, versions, ended_by
