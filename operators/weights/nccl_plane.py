"""The trainer ranks' side of the `nccl` weight path: vLLM's trainer-side NCCL engine over a rank's weights.

Every trainer rank makes a `SyncSender` (`rank_sender`; ZeRO-3's gathers are collectives: every rank iterates the source in
lockstep); rank 0 opens the communicator with the engines and drives them through vLLM's `RayVLLMWeightSyncClient`
(Ray actors with vLLM's weight-sync surface: operators/engines/weight_sync.py, which pause decoding for the
update). `send()` is vLLM's `send_weights`: the source's `metadata()` (nothing gathered, operators/weights/source.py)
becomes the update info, then iteration, one module gathered at a time, is broadcast and checked against it.

The backend: vLLM's `nccl` where the rank has CUDA, else `streamrl_nccl_gloo` (the same engines with a gloo
communicator: operators/weights/vllm_nccl.py). One communicator for the engines given at `SyncSender` time (an
NCCL communicator has a fixed size); engines that join later and the watchdog are not built yet (docs/deploy.md).
"""

from __future__ import annotations

import time
from typing import Any

from operators.weights.plane import WeightTransferError
from operators.weights.source import TrainerWeights, vllm_weight_source


def nccl_backend(device_type: str) -> str:
    """vLLM's backend for the nccl path on a `device_type` process (a trainer rank or an engine): vLLM's `nccl`
    on CUDA; the gloo stand-in elsewhere."""
    if device_type == "cuda":
        return "nccl"
    from operators.weights.vllm_nccl import BACKEND

    return BACKEND


def trainer_init_info(backend: str, host: str, port: int, workers: int, rank: int, timeout_s: float,
                      packed: bool = True, buffer_bytes: int | None = None, buffers: int | None = None):
    """vLLM's trainer-side init info for `backend`: rank 0 and `workers` engine workers (world 1 + workers)."""
    wire: dict[str, Any] = {"packed": packed}
    if buffer_bytes is not None:
        wire["packed_buffer_size_bytes"] = int(buffer_bytes)
    if buffers is not None:
        wire["packed_num_buffers"] = int(buffers)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(host, int(port), 1 + int(workers), rank=int(rank), **wire)
    from operators.weights.vllm_nccl import GlooNcclTrainerInitInfo

    return GlooNcclTrainerInitInfo(host, int(port), 1 + int(workers), rank=int(rank), timeout_s=float(timeout_s),
                                   **wire)


class SyncSender:
    """One trainer rank's side (see the module docstring). `weights`: the rank's TrainerWeights; `init`: the
    fields of `trainer_init_info` but `rank` and `backend` (the same on every rank: rank 0 hosts the rendezvous
    at `host:port`); `engines`: the engines' actor handles (rank 0 drives them; other ranks pass them too)."""

    def __init__(self, weights: TrainerWeights, rank: int, device_type: str, engines: list, init: dict):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if rank == 0 and not engines:
            raise ValueError("the nccl weight path needs at least one engine to send to")
        self.rank = rank
        self.engines, self.timeout_s = len(engines), float(init.get("timeout_s", 300.0))
        info = trainer_init_info(nccl_backend(device_type), rank=rank, **init)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(list(engines)), source=vllm_weight_source(weights))

    def send(self) -> float:
        """One update (a collective over the trainer ranks); the seconds this rank was held."""
        start = time.perf_counter()
        try:
            self.engine.send_weights()
        except Exception as err:
            # vLLM's engine leaves the communicator unusable after a failed round (the peers may be stuck in the
            # matching broadcast): the caller tears the attempt down and restarts from the last checkpoint
            raise WeightTransferError(
                f"trainer rank {self.rank}: the weight update to {self.engines} engine(s) failed after "
                f"{time.perf_counter() - start:.1f}s ({self.timeout_s:.0f}s allowed per wait, "
                f"rollout.weight_timeout_s): an engine stopped receiving or died: {type(err).__name__}: {err}"
            ) from err
        return time.perf_counter() - start

    def close(self) -> None:
        self.engine.shutdown()


def rank_sender(module, walk, lora: bool, rank: int, device_type: str, engines: list, init: dict) -> SyncSender:
    """A trainer rank's SyncSender over `module`'s weights: `walk()` is the rank's weight walk (a Publisher's
    `weights`: buckets.named_weights, or lora_merge.merged_weights with LoRA)."""
    return SyncSender(TrainerWeights(module, walk, lora=lora), rank, device_type, engines, init)
