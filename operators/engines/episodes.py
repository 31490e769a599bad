"""Multi-turn episodes on the in-flight rollout loop: the model's turns alternate with an environment's
answers (operators/environment.py), every turn a request of its own to the engine.

`MultiTurnEpisodes` is the part of `RolloutLoop` (operators/engines/rollout.py) that runs them, mixed into
it: it uses the loop's engine, its `version` and `tokens_received`, its slot bookkeeping (`_slots`,
`_acquire`, `_release`, `episodes_active`, `_swap_waiting`), its request ids (`_ids`), its failure
(`_failure`, `_raise_failure`), `_run`, its environment thread pool (`_env_executor`) and its pause
log (`_pauses`). An environment's
`reset` and `step` run in that thread pool, so a slow tool never holds the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time

from operators.engines.base import GroupSample, SamplingParams
from operators.engines.rollout_records import Episode, GroupResult
from operators.environment import Turn, env_step_problem


class EnvOutputError(ValueError):
    """An environment answered a turn with something that is not a valid EnvStep (env_step_problem)."""


class MultiTurnEpisodes:
    """RolloutLoop's multi-turn side (see the module's docstring for what it takes from the loop)."""

    def submit_episodes(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int], uids: list[str],
        make_env, rows: list[dict], max_turns: int, max_tokens: int,
    ) -> list[concurrent.futures.Future]:
        """Start `params.n` multi-turn episodes per prompt (`make_env()` makes each one's environment,
        reset with the prompt's `rows` entry); each future resolves to a GroupResult whose `episodes` say
        what happened. A turn is one request of at most `params.max_new_tokens` tokens; an episode has at
        most `max_turns` turns and `max_tokens` tokens after its prompt (observations included)."""
        self._raise_failure()
        return [self._run(self._episode_group(list(ids), params, seed, uid, make_env, row, max_turns, max_tokens))
                for ids, seed, uid, row in zip(prompt_token_ids, seeds, uids, rows)]

    # --- on the loop -------------------------------------------------------------------------------

    async def _episode_group(self, prompt_ids: list[int], params: SamplingParams, seed: int, uid: str, make_env,
                             row: dict, max_turns: int, max_tokens: int) -> GroupResult:
        if self._failure is not None:
            self._raise_failure()
        start = time.time()
        one = SamplingParams(**{**params.__dict__, "n": 1})
        request_id = f"{uid}-{next(self._ids)}"
        episodes = await asyncio.gather(*[
            self._episode(prompt_ids, one, (seed + index) % (2**31 - 1), f"{request_id}.{index}", make_env, row,
                          max_turns, max_tokens) for index in range(params.n)])
        end = time.time()
        paused = sum(max(0.0, min(e, end) - max(s, start)) for s, e in self._pauses)
        # texts: the whole transcript after the prompt (the policy's turns and the observations)
        sample = GroupSample([e[0] for e in episodes], [e[1] for e in episodes],
                             [self.engine.decode(e[0]) for e in episodes])
        return GroupResult(sample, [e[2] for e in episodes], start, end, paused, episodes=[e[3] for e in episodes])

    async def _episode(self, prompt_ids: list[int], params: SamplingParams, seed: int, request_id: str, make_env,
                       row: dict, max_turns: int, max_tokens: int):
        """One episode: (response tokens, their log-probs, their versions, Episode). Observation tokens get
        log-prob 0.0 and the version of the turn before them; they are masked out of the loss."""
        loop = asyncio.get_running_loop()
        async with self._slots:  # without partial rollout, a swap that waits for episodes holds new ones
            await self._slots.wait_for(lambda: not self._swap_waiting)
            self.episodes_active += 1
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[int] = []
        turns: list[dict] = []
        episode = Episode(mask, turns, "max_turns")
        try:
            try:
                env = make_env()
                await loop.run_in_executor(self._env_executor, env.reset, row)
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
                ids, lps, vers, ended_by = await self._turn(prompt_ids + tokens, turn_params, turn_seed,
                                                            f"{request_id}.t{index}", stop)
                history = self.engine.decode(tokens)
                tokens += ids
                logprobs += lps
                versions += vers
                mask += [1] * len(ids)
                text = self.engine.decode(ids)
                record = {"text": text, "tokens": len(ids), "ended_by": ended_by,
                          "version": min(vers) if vers else self.version}
                turns.append(record)
                try:
                    result = await loop.run_in_executor(self._env_executor, env.step,
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
        finally:
            async with self._slots:
                self.episodes_active -= 1
                self._slots.notify_all()
        return tokens, logprobs, versions, episode

    async def _turn(self, context: list[int], params: SamplingParams, seed: int, request_id: str,
                    stop: tuple[str, ...]) -> tuple[list[int], list[float], list[int], str]:
        """One model turn: (tokens, log-probs, versions, how it ended). A stop string ends it at the token
        that completes it (the request is aborted there)."""
        await self._acquire(1)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ended_by = "length"
        stops = set(getattr(self.engine, "stop_ids", None) or (getattr(self.engine, "eos_id", None),))
        try:
            stream = self.engine.stream(context, params, seed, request_id, f"policy-v{self.version}")
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    version = self.version
                    self.tokens_received += len(delta.token_ids)
                    for token, logprob in zip(delta.token_ids, delta.logprobs):
                        tokens.append(token)
                        logprobs.append(logprob)
                        versions.append(version)
                        if token in stops:
                            ended_by = "eos"
                            break
                        if stop and any(self.engine.decode(tokens).endswith(s) for s in stop):
                            ended_by = "stop"
                            break
                    if ended_by != "length":
                        break
                    if delta.finished:
                        break
            if ended_by == "stop":
                await self.engine.abort(request_id)
        finally:
            await self._release(1)
        return tokens, logprobs, versions, ended_by
