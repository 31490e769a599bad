"""An OpenAI-compatible rollout endpoint over the in-flight rollout loop (issue 47, item 3).

An agent written against the `openai` client samples from the policy being trained: it points the client's
`base_url` at `RolloutEndpoint.base_url` (127.0.0.1 only) with the endpoint's token as its `api_key`, and calls
`/v1/chat/completions` or `/v1/completions`. Each call samples through the loop like any group (the loop's
admission, slots and weight updates; partial rollout may move a call to a newer version mid-decode), and is
recorded with what training needs: the prompt's token ids as the engine read them, the sampled token ids,
their log-probs and the policy version of every token. Training reads those records (`take(episode)`), never
a re-tokenisation of the text the client saw.

    endpoint = RolloutEndpoint(loop, renderer, temperature=0.7, max_new_tokens=256)
    client = openai.OpenAI(base_url=endpoint.start(), api_key=endpoint.token)
    client.chat.completions.create(model="policy", messages=[...], extra_body={"episode_id": "ep-1"})
    calls = endpoint.take("ep-1")   # RecordedCall per call, in the order they finished

Calls are grouped by the episode id the client sends: `episode_id` in the body (the openai client's
`extra_body`) or the `X-Episode-Id` header. A call without one is refused: its tokens could never be
trained on. Sampling follows the job: the endpoint samples at the rollout's temperature and top_p, because
the recorded log-probs are under that distribution and the trainer's corrections assume it; a request that
asks for another temperature or top_p is refused (400) naming the setting, rather than silently changed.
`stop` strings end a response at the token that completes one (the engine's request is aborted there, as an
episode's turn is: operators/engines/episodes.py); the text returned stops before the string, while the
record keeps every token sampled. Not served yet (400, said so): streaming, `tools`.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from operators.common.prompts import PromptRenderer, message_problem
from operators.engines.base import SamplingParams

if TYPE_CHECKING:
    from operators.engines.rollout import RolloutLoop

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_N = 64


@dataclass
class RecordedCall:
    """One sampled response of one call: the tokens training uses, as the engine produced them."""

    episode: str
    call: int  # the endpoint's call counter (a call with n > 1 records n responses under one number)
    route: str  # "chat" or "completions"
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling distribution (the rollout's temperature)
    versions: list[int]  # the policy version each token was sampled from
    text: str
    finish_reason: str  # "stop" (a stop token) or "length" (max tokens)


@dataclass
class EpisodeRules:
    """An episode the endpoint was told to expect (a job's agent episode, operators/engines/agent_episodes.py):
    its calls sample at `temperature` (0: the evaluator's greedy episodes) with seeds from `seed`, at most
    `max_calls` of them."""

    seed: int
    temperature: float
    max_calls: int
    calls: int = 0
    over_budget: bool = False  # a call past max_calls was refused (the episode ends as cut, not as an error)


class RequestError(ValueError):
    """A request the endpoint refuses: the HTTP status and the OpenAI error's `param`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class CallLedger:
    """The recorded calls by episode; `take` hands an episode's calls over once (thread-safe: the endpoint
    records on the loop's thread, training takes from its own)."""

    calls: dict[str, list[RecordedCall]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, records: list[RecordedCall]) -> None:
        with self.lock:
            for record in records:
                self.calls[record.episode].append(record)

    def take(self, episode: str) -> list[RecordedCall]:
        with self.lock:
            return self.calls.pop(episode, [])

    def episodes(self) -> list[str]:
        with self.lock:
            return list(self.calls)


def sampling_of(body: dict, *, temperature: float, top_p: float, max_new_tokens: int, seed: int) -> SamplingParams:
    """The request's sampling parameters under the job's rules; RequestError naming the field otherwise."""
    for name in ("stream", "tools", "tool_choice", "functions", "response_format"):
        if body.get(name):
            raise RequestError(f"{name} is not served by the rollout endpoint yet: it answers whole responses, "
                               "as text", param=name)
    for name, fixed, setting in (("temperature", temperature, "rollout.temperature"), ("top_p", top_p, "top_p 1.0")):
        asked = body.get(name)
        if asked is not None and abs(float(asked) - fixed) > 1e-9:
            raise RequestError(f"{name} {asked} differs from the job's ({fixed}): the endpoint samples at "
                               f"{setting}, which the recorded log-probs and the trainer's corrections assume; "
                               f"leave {name} out or send {fixed}", param=name)
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(f"n {n!r}: give a whole number from 1 to {MAX_N}", param="n")
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or max_new_tokens
    if not isinstance(asked, int) or not 1 <= asked <= max_new_tokens:
        raise RequestError(f"max_tokens {asked!r}: give 1 to {max_new_tokens} (the job's rollout.max_new_tokens)",
                           param="max_tokens")
    call_seed = body.get("seed")
    return SamplingParams(n=n, max_new_tokens=asked, temperature=temperature, top_p=top_p,
                          seed=int(call_seed) if call_seed is not None else seed)


def stop_strings(body: dict) -> tuple[str, ...]:
    """The request's `stop` (a string or up to 4 of them; OpenAI's rule) as a tuple."""
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s
                                                                                   for s in stops):
        raise RequestError("stop: give one non-empty string or a list of up to 4", param="stop")
    return tuple(stops)


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """The text up to the first stop string (OpenAI returns a response without its stop sequence)."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def finish_reason(token_ids: list[int], max_tokens: int, stop_ids) -> str:
    if token_ids and token_ids[-1] in stop_ids:
        return "stop"
    return "length" if len(token_ids) >= max_tokens else "stop"


class RolloutEndpoint:
    """`/v1/chat/completions`, `/v1/completions` and `/v1/models` over `loop` (a RolloutLoop), on
    127.0.0.1 with a bearer token. `renderer` turns a chat's messages into the prompt's token ids (the job's
    chat template); `temperature`, `top_p`, `max_new_tokens`: the rollout's, which every call samples under.
    `seed`: the first call's seed (each call takes the next one unless it sends its own)."""

    def __init__(self, loop: RolloutLoop, renderer: PromptRenderer, *, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 256, seed: int = 0, token: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, model: str = "policy"):
        if host not in LOOPBACK:
            raise ValueError(f"the rollout endpoint listens on the loopback interface only ({', '.join(LOOPBACK)}), "
                             f"not {host!r}: an agent on another machine reaches it through its own tunnel")
        self.loop, self.renderer, self.model = loop, renderer, model
        self.temperature, self.top_p, self.max_new_tokens = float(temperature), float(top_p), int(max_new_tokens)
        self.token = token or secrets.token_urlsafe(24)
        self.host, self.port = host, port
        self.ledger = CallLedger()
        # with open_episodes_only (a job's agents), only episodes opened with `open_episode` may call, and a call
        # that finishes after its episode closed is dropped; otherwise any episode id is recorded
        self.open_episodes_only = False
        self._open: dict[str, EpisodeRules] = {}
        self._seeds = itertools.count(seed)
        self._calls = itertools.count()
        self._runner = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> str:
        """Serve on the loop's event loop; the base URL for the client."""
        self.port = self.loop.run_on_loop(self._start()).result(timeout=60)
        return self.base_url

    def close(self) -> None:
        if self._runner is not None:
            self.loop.run_on_loop(self._runner.cleanup()).result(timeout=30)
            self._runner = None

    def take(self, episode: str) -> list[RecordedCall]:
        """The calls recorded for `episode`, in the order they finished; handed over once."""
        return self.ledger.take(episode)

    def open_episode(self, episode: str, rules: EpisodeRules) -> None:
        """Expect calls of `episode` under `rules` (on the loop's thread, as the calls are answered)."""
        self._open[episode] = rules

    def close_episode(self, episode: str) -> list[RecordedCall]:
        """No more calls of `episode` (a late one is refused, one still sampling is dropped); its calls."""
        self._open.pop(episode, None)
        return self.ledger.take(episode)

    # --- on the loop ---------------------------------------------------------------------------------

    async def _start(self) -> int:
        from aiohttp import web

        @web.middleware
        async def guard(request, handler):
            return await self._guarded(request, handler)

        app = web.Application(middlewares=[guard], client_max_size=16 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        return int(self._runner.addresses[0][1])

    def _error(self, status: int, message: str, param: str | None = None):
        from aiohttp import web

        kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
        return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                                 status=status)

    async def _guarded(self, request, handler):
        if not hmac.compare_digest(request.headers.get("Authorization", ""), f"Bearer {self.token}"):
            return self._error(401, "missing or wrong bearer token: give the client api_key=<the endpoint's token>")
        try:
            return await handler(request)
        except RequestError as err:
            return self._error(err.status, str(err), err.param)

    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the body is not JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the body is not a JSON object")
        return body

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": "streamrl"}]})

    async def _chat(self, request):
        body = await self._body(request)
        messages = body.get("messages")
        problem = message_problem(messages) or self.renderer.problem(messages)
        if problem:
            raise RequestError(f"messages {problem}", param="messages")
        prompt_ids = self.renderer.encode([messages])[0]
        return await self._answer(request, body, "chat", prompt_ids)

    async def _completions(self, request):
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the client's one-prompt list
        if isinstance(prompt, str) and prompt:
            prompt_ids = list(self.renderer.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = [int(t) for t in prompt]  # token ids, as the client tokenised them
        else:
            raise RequestError("prompt: give one non-empty text or one list of token ids", param="prompt")
        return await self._answer(request, body, "completions", prompt_ids)

    async def _answer(self, request, body: dict, route: str, prompt_ids: list[int]):
        from aiohttp import web

        episode = body.get("episode_id") or request.headers.get("X-Episode-Id")
        if not episode or not isinstance(episode, str):
            raise RequestError("each call names its episode, so its tokens can be trained on: send "
                               "extra_body={'episode_id': ...} with the openai client, or the X-Episode-Id header",
                               param="episode_id")
        rules = self._open.get(episode)
        temperature, seed = self.temperature, None
        if rules is not None:
            if rules.calls >= rules.max_calls:
                rules.over_budget = True
                raise RequestError(f"episode {episode!r} has made its {rules.max_calls} calls "
                                   "(rollout.environment.max_turns)", param="episode_id")
            temperature, seed = rules.temperature, (rules.seed + 1_000_003 * rules.calls) % (2**31 - 1 - MAX_N)
            rules.calls += 1
        elif self.open_episodes_only:
            raise RequestError(f"episode {episode!r} is not running (it ended, ran out of time, or was never "
                               "started by the job): its calls cannot be trained on", status=409, param="episode_id")
        params = sampling_of(body, temperature=temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                             seed=next(self._seeds) if seed is None else seed)
        stops = stop_strings(body)
        call = next(self._calls)
        try:
            records = await (self._sample_stopped(episode, call, route, prompt_ids, params, stops) if stops
                             else self._sample(episode, call, route, prompt_ids, params))
        except ValueError as err:  # the engine's refusal of this call (a prompt longer than the model's length)
            raise RequestError(f"the engine refused the call: {err}", param="messages") from None
        if rules is None or self._open.get(episode) is rules:  # a call that outlived its episode is not kept
            self.ledger.add(records)
        return web.json_response(self._reply(body, route, call, records))

    async def _sample(self, episode: str, call: int, route: str, prompt_ids: list[int],
                      params: SamplingParams) -> list[RecordedCall]:
        result = await self.loop.sample_async(prompt_ids, params, params.seed, f"{episode}-call{call}")
        stop_ids = set(getattr(self.loop.engine, "stop_ids", ()))
        return [RecordedCall(episode, call, route, list(prompt_ids), list(tokens), list(logprobs), list(versions),
                             text, finish_reason(tokens, params.max_new_tokens, stop_ids))
                for tokens, logprobs, versions, text in zip(result.sample.token_ids, result.sample.logprobs,
                                                             result.token_versions, result.sample.texts)]

    async def _sample_stopped(self, episode: str, call: int, route: str, prompt_ids: list[int],
                              params: SamplingParams, stops: tuple[str, ...]) -> list[RecordedCall]:
        """Each of the n responses as one turn of the loop's episode runner, which ends it at a stop string."""
        import asyncio

        one = SamplingParams(**{**params.__dict__, "n": 1})
        turns = await asyncio.gather(*[
            self.loop.episodes.turn(list(prompt_ids), one, (params.seed + index) % (2**31 - 1),
                                    f"{episode}-call{call}.{index}", stops, stop_inside=True)
            for index in range(params.n)])
        return [RecordedCall(episode, call, route, list(prompt_ids), tokens, logprobs, versions,
                             before_stop(self.loop.engine.decode(tokens), stops),
                             "length" if ended_by == "length" else "stop")
                for tokens, logprobs, versions, ended_by in turns]

    def _reply(self, body: dict, route: str, call: int, records: list[RecordedCall]) -> dict[str, Any]:
        tokenizer = self.renderer.tokenizer
        choices = []
        for index, record in enumerate(records):
            pieces = tokenizer.convert_ids_to_tokens(record.token_ids)
            if route == "chat":
                choice = {"index": index, "finish_reason": record.finish_reason,
                          "message": {"role": "assistant", "content": record.text}, "logprobs": None}
                if body.get("logprobs"):
                    choice["logprobs"] = {"content": [{"token": piece, "logprob": lp, "bytes": None,
                                                       "top_logprobs": []}
                                                      for piece, lp in zip(pieces, record.logprobs)]}
            else:
                choice = {"index": index, "finish_reason": record.finish_reason, "text": record.text,
                          "logprobs": ({"tokens": pieces, "token_logprobs": record.logprobs, "top_logprobs": None,
                                        "text_offset": None} if body.get("logprobs") is not None else None)}
            choices.append(choice)
        completion = sum(len(r.token_ids) for r in records)
        prompt = len(records[0].prompt_token_ids) if records else 0
        return {"id": f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{records[0].episode}-{call}",
                "object": "chat.completion" if route == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion},
                # what an agent may log beside its transcript: the policy versions this call sampled from
                "policy_versions": sorted({v for r in records for v in r.versions})}
