"""An in-flight vLLM engine that a trainer updates through vLLM's own weight-sync protocol: the surface vLLM's
trainer-side engines drive (`VLLMWeightSyncClient`: `init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`), so vLLM's `RayVLLMWeightSyncClient` drives a Ray actor of this class
unchanged, as it drives an AsyncLLM actor.

What this adds to AsyncLLM's methods is vLLM's rule for receiving engines: decoding is paused from
`start_weight_update` to `finish_weight_update` (receiving while decoding could deadlock against
tensor-parallel all-reduces), with the requests in flight kept and resumed on the new weights, and the pause
timed. The engine is an AsyncVLLMEngine with `weight_transfer='nccl'`: vLLM's NCCL engine, whose communicator
is gloo on a CPU (operators/weights/vllm_nccl.py).
"""

from __future__ import annotations

import time
import uuid


class SyncedEngine:
    """An AsyncVLLMEngine (operators/engines/vllm_async.py) with vLLM's weight-sync surface. Wrap it in
    `ray.remote` (its methods are coroutines: an async actor), call `start`, then hand the actor to
    `RayVLLMWeightSyncClient`. `pauses`: the seconds decoding was paused for each update."""

    def __init__(self, model_path: str, **options):
        from operators.engines.factory import make_in_flight_engine

        self.engine = make_in_flight_engine("vllm", model_path, **{**options, "weight_transfer": "nccl"})
        self.pauses: list[float] = []
        self._paused_at: float | None = None

    async def start(self) -> None:
        await self.engine.start()

    # --- vLLM's weight-sync surface -------------------------------------------------------------------------

    async def init_weight_transfer_engine(self, request) -> None:
        await self.engine.engine.init_weight_transfer_engine(request)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.engine.engine.shutdown_weight_transfer_engine()

    async def start_weight_update(self) -> None:
        self._paused_at = time.perf_counter()
        await self.engine.pause("keep")  # requests in flight stay, frozen, and finish on the new weights
        try:
            await self.engine.engine.start_weight_update()
        except BaseException:
            await self._resume()
            raise

    async def update_weights(self, request) -> None:
        await self.engine.engine.update_weights(request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        try:
            await self.engine.engine.finish_weight_update(weight_version)
        finally:
            await self._resume()

    async def update_weight_version(self, weight_version: str) -> None:
        await self.engine.engine.update_weight_version(str(weight_version))

    async def get_weight_version(self) -> str:
        return await self.engine.engine.get_weight_version()

    # --- what a caller checks after an update ---------------------------------------------------------------

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs of `token_ids` under the weights served now (the served-policy probe)."""
        return await self.engine.score(token_ids, f"probe-{uuid.uuid4().hex[:8]}")

    async def check_weights(self, digests: dict, dtypes: dict, shapes: dict) -> list[dict]:
        """Each worker's comparison of its model with the trainer's digests (vllm_worker.WeightLoader)."""
        return await self.engine.engine.collective_rpc("check_weights", args=(digests, dtypes, shapes))

    async def paused_seconds(self) -> list[float]:
        return list(self.pauses)

    async def close(self) -> None:
        await self.engine.shutdown()

    async def _resume(self) -> None:
        await self.engine.resume()
        if self._paused_at is not None:
            self.pauses.append(time.perf_counter() - self._paused_at)
            self._paused_at = None
