"""vLLM's weight-transfer engine over torch.distributed gloo: the engine workers' side of the gloo plane
(operators/weights/gloo_plane.py), run inside vLLM's worker processes.

Registered as backend `streamrl_gloo` through vLLM's `WeightTransferEngineFactory` when this module is
imported, which every vLLM worker does: it is the module of our `worker_extension_cls`
(operators/engines/vllm_worker.py), imported when the worker is built, before the model loads and the
worker creates its transfer engine.

The protocol is vLLM's (`init_transfer_engine`, then per update `start_weight_update`,
`update_weights`, `finish_weight_update`); what gloo changes is when the bytes move. A receiving thread
takes every version the trainer broadcasts as it comes, into host buffers, while the engine goes on
decoding. `update_weights({"version": v})` then only applies the staged version (the layerwise reload
vLLM's NCCL engine uses: `initialize_layerwise_reload` in start, `model.load_weights`, then
`finalize_layerwise_reload` in finish, which also repacks the CPU backend's linear weights), so the
engine pauses for the apply alone.

Verified updates: when the layout carries the trainer's digests, the thread checks the bytes it got
(transport), and `finish_weight_update` checks the model's tensors that vLLM keeps under the trainer's
name and shape (embeddings, norms, an untied head) after the load (applied). `last_report()` (through the
worker extension) says what was checked.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from operators.common.faults import FaultPoints
from operators.weights.buckets import WeightBucket, WeightSet
from operators.weights.checksums import applied_mismatches, transport_mismatches
from operators.weights.gloo_wire import open_group, receive_version
from operators.weights.host_buffers import BucketBuffers

logger = logging.getLogger(__name__)

BACKEND = "streamrl_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int
    engine_id: str = ""
    timeout_s: float = 300.0
    fault_dir: str | None = None  # operators/common/faults.py, for tests and chaos runs
    fault_points: list = field(default_factory=list)
    fault_hold_s: float = 30.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    version: int


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: GlooInitInfo | None = None
        self._cond = threading.Condition()
        self._staged: tuple[int, list[WeightBucket], dict | None, list[str]] | None = None
        self._received_failure: BaseException | None = None
        self._applying: tuple[int, list[WeightBucket], dict | None, list[str]] | None = None
        self.report: dict = {}
        self._stop = False

    # --- vLLM's protocol ---------------------------------------------------------------------

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Start the receiving thread (it joins the trainer's group, then takes every version)."""
        self.info = init_info
        threading.Thread(target=self._receive_loop, daemon=True, name="streamrl-weights-recv").start()

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class also synchronizes an accelerator, which a CPU has not
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Apply the staged version `update_info.version` (waiting for its last bytes if they are still on
        their way; a newer staged version is applied instead, and reported)."""
        timeout_s = self.info.timeout_s if self.info else 300.0
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._received_failure is not None
                or (self._staged is not None and self._staged[0] >= update_info.version), timeout_s)
            if self._received_failure is not None:
                raise RuntimeError(f"weight receiver failed: {self._received_failure}")
            if not ready:
                raise TimeoutError(f"policy version {update_info.version} was not received from the trainer within "
                                   f"{timeout_s:.0f}s (rollout.weight_timeout_s)")
            version, buckets, digests, transport_bad = self._staged
            self._staged = None
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights((name, tensor.to(self.device)) for name, tensor in WeightSet(buckets).tensors())
        self._applying = (version, buckets, digests, transport_bad)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self._applying is None:
            return
        version, buckets, digests, transport_bad = self._applying
        self._applying = None
        report = {"version": version, "verified": digests is not None, "transport_checked": 0, "applied_checked": 0,
                  "mismatches": list(transport_bad)}
        if digests is not None:
            report["transport_checked"] = len(digests)
            dtypes = {name: b.dtype for b in buckets for name in b.names}  # of the version applied, not the next
            shapes = {name: shape for b in buckets for name, shape in zip(b.names, b.shapes)}
            checked, bad = applied_mismatches(self.model, digests, dtypes, shapes)
            report["applied_checked"], report["mismatches"] = checked, report["mismatches"] + bad
        self.report = report

    def shutdown(self) -> None:
        self._stop = True

    # --- the receiving thread ----------------------------------------------------------------

    def _receive_loop(self) -> None:
        info = self.info
        faults = FaultPoints(info.fault_dir, tuple(info.fault_points), info.fault_hold_s)
        rank = 1 + self.parallel_config.data_parallel_index * self.parallel_config.world_size + self.parallel_config.rank
        try:
            group = open_group(info.host, info.port, rank, info.world_size, info.timeout_s)
            buffers = BucketBuffers()  # about two versions' host buffers: the one staged or applied, the next
            while not self._stop:
                version, layout, buckets = receive_version(group, info.timeout_s, on_layout=lambda v: faults.reach(
                    # the generate actor is the parent of the engine core, where this worker runs
                    "weights_receiving", version=v, engine_id=info.engine_id, actor_pid=os.getppid()),
                    buffers=buffers)
                digests = layout.get("digests")
                bad = transport_mismatches(buckets, digests) if digests else []
                with self._cond:
                    self._staged = (version, buckets, digests, bad)
                    self._cond.notify_all()
        except BaseException as err:  # the update waiting for it says so
            if not self._stop:
                # the trainer's side closing at the end of a job reads the same as its death: the update that
                # waits for this receiver (receive_weights) raises it; nothing to say until then
                logger.info("streamrl weight receiver stopped: %s", err)
                with self._cond:
                    self._received_failure = err
                    self._cond.notify_all()

class QuietRotaryReload(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" on every update: the rotary
    cos/sin cache is a buffer derived from the config, never in a checkpoint, and vLLM puts the one it
    computed back (layerwise.py `_place_kernel_tensors`). Drop that one line; any other layer still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def register() -> None:
    """Register the backend with vLLM's factory (once per process)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, GlooWeightTransferEngine.__name__)
    except ValueError:  # already registered in this process
        return
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(QuietRotaryReload())


register()
