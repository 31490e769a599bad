"""The weight plane: a trainer's weights pushed to every vLLM engine over a collective, no files, no object store.

vLLM 0.32's weight-transfer API is the engine side: `AsyncLLM.init_weight_transfer_engine`, then per update
`start_weight_update` / `update_weights` / `finish_weight_update(weight_version)`, each run by a
`WeightTransferEngine` in every vLLM worker. The backend is chosen by `rollout.weight_transfer`:

* `gloo` (CPUs, CI): our engine, `operators/engines/gloo_transfer.py`, registered through vLLM's
  `WeightTransferEngineFactory`. The bytes travel over torch.distributed gloo.
* `nccl` / `ipc` (GPUs): vLLM's own engines, selected by the same config; not run here (no GPU).

One update, as this module's `WeightSender` drives it on the trainer's rank 0:

1. The trainer ranks gather the weights module by module into host buckets in the training dtype
   (operators/weights.py `pack_buckets`; ZeRO-3 gathers are collectives, so every rank takes part).
   That is all the trainer ranks wait for: `send` hands the buckets to the sender's thread and returns.
2. The sender's thread broadcasts them to every registered engine at once: one gloo group per engine
   (trainer rank 0 and that engine's workers), all groups' broadcasts posted before any is awaited.
   Each engine's workers receive in a thread of their own while the engine goes on decoding.
3. When an engine's group has the whole version, the sender records the delivery in the policy store
   (`delivered`). The engine's rollout loop, waiting for it, pauses decoding only to apply the staged
   weights (start / update / finish), confirms the version and resumes.

Wire format, per version and group: an int64 header `[version, layout bytes]`, the layout as UTF-8 JSON
(the buckets' dtypes, names, shapes and byte sizes, and the tensors' sha256 digests when the update is
verified), then each bucket's bytes. Every wait past the header has `timeout_s` and names what it
waited for.

Engines join at any time (a restart, an autoscaled actor): each one registers its rendezvous endpoint
with the policy store; the sender connects it before the next update and, when idle, at once, and sends
it the latest version, which it keeps (host memory, one copy: what the object store used to hold).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import numpy as np

from operators.weights import DTYPES, WeightBucket

logger = logging.getLogger(__name__)

WIRE_PREFIX = "streamrl-weights"
IDLE_WAIT_S = 7 * 24 * 3600  # an engine waiting for the next version waits as long as the job runs
POLL_S = 0.5  # how often an idle sender looks for engines that joined


class WeightTransferError(RuntimeError):
    """A weight transfer failed or timed out; the message names the engine and what was waited for."""


class WeightMismatch(RuntimeError):
    """An engine holds weights other than the trainer's (checksums differ)."""


@dataclass(frozen=True)
class Endpoint:
    """Where an engine's rendezvous store listens, and how many of its workers receive."""

    engine_id: str
    host: str
    port: int
    workers: int = 1  # vLLM workers of the engine (tensor parallel size); each receives the whole version

    @property
    def world_size(self) -> int:
        return 1 + self.workers  # the trainer's sender is rank 0


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A gloo group of its own (not torch's default group, which DeepSpeed and vLLM own), rendezvous at the
    engine's store. Blocks until every member joined or `timeout_s` passed."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return ProcessGroupGloo(PrefixStore(WIRE_PREFIX, store), rank, world_size, timedelta(seconds=timeout_s))


def post_broadcast(group, tensor, timeout_s: float):
    """Start a broadcast from rank 0 of `group`; the Work to wait on."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def bucket_bytes(bucket: WeightBucket):
    """The bucket's buffer as a flat uint8 torch tensor sharing its memory."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bucket.data).view(np.uint8))


def digests_of(buckets: Iterable[WeightBucket]) -> dict[str, str]:
    """name -> sha256 of the tensor's bytes as they travel (the training dtype)."""
    return {name: hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()
            for bucket in buckets for name, array in bucket.arrays()}


def layout_of(version: int, buckets: list[WeightBucket], digests: dict[str, str] | None) -> dict:
    return {
        "version": version,
        "buckets": [{"dtype": b.dtype, "names": b.names, "shapes": [list(s) for s in b.shapes], "nbytes": b.nbytes}
                    for b in buckets],
        "digests": digests,
    }


def encode_layout(layout: dict):
    """(header int64[2], layout uint8[n]) as torch tensors."""
    import torch

    raw = json.dumps(layout, separators=(",", ":")).encode()
    header = torch.tensor([int(layout["version"]), len(raw)], dtype=torch.int64)
    return header, torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def post_version(group, header, layout, payload: list, timeout_s: float) -> list:
    """Start sending one version on `group` (rank 0): its header, layout and buckets. The Works, in order."""
    return ([post_broadcast(group, header, timeout_s), post_broadcast(group, layout, timeout_s)]
            + [post_broadcast(group, tensor, timeout_s) for tensor in payload])


def receive_version(group, timeout_s: float, idle_s: float = IDLE_WAIT_S, on_layout=None, buffers=None):
    """Receive one version on `group` (a receiving rank): (version, layout, buckets). Waits up to `idle_s` for
    the header (the next version may be a train step away) and `timeout_s` for each part after it.
    `on_layout(version)`: called between the layout and the buckets (a fault point). `buffers`: an
    operators.host_buffers.BucketBuffers the buckets are received into, reused once a version is dropped
    (fresh host memory pays a page fault per page on first touch)."""
    import torch

    header = torch.zeros(2, dtype=torch.int64)
    post_broadcast(group, header, idle_s).wait()
    version, size = int(header[0]), int(header[1])
    raw = torch.zeros(size, dtype=torch.uint8)
    post_broadcast(group, raw, timeout_s).wait()
    layout = json.loads(raw.numpy().tobytes())
    if on_layout is not None:
        on_layout(version)
    buckets = []
    for spec in layout["buckets"]:
        nbytes = int(spec["nbytes"])
        slot = None if buffers is None else buffers.take(torch.uint8, nbytes)
        data = torch.empty(nbytes, dtype=torch.uint8) if slot is None else slot.buffer[:nbytes]
        try:
            post_broadcast(group, data, timeout_s).wait()
        except BaseException:
            if slot is not None:  # the buffer holds part of a version nobody will read
                slot.release()
            raise
        root = data.numpy()  # every view of the bucket keeps this array alive (host_buffers.py)
        if slot is not None:
            slot.hand_out(root)
        buckets.append(WeightBucket(spec["dtype"], list(spec["names"]), [tuple(s) for s in spec["shapes"]],
                                    root.view(DTYPES[spec["dtype"]][1])))
    return version, layout, buckets


class WeightSender:
    """Trainer rank 0's side of the weight plane (see the module docstring).

    `store`: the policy store's actor handle (engines register there; deliveries are recorded there).
    `verify_every`: digests travel with the first update and every n-th after it (0: only the first),
    with any update after `verify_next()`, and with each engine's first delivery (a restarted one too). `timeout_s`: the most any transfer wait may take."""

    def __init__(self, store, timeout_s: float = 300.0, verify_every: int = 0, name: str = "trainer"):
        self.store, self.timeout_s, self.verify_every, self.name = store, float(timeout_s), int(verify_every), name
        self._groups: dict[str, tuple[Endpoint, Any]] = {}
        self._verified: set[str] = set()  # engines that were sent checksums at least once
        self._latest: tuple[int, list[WeightBucket], dict] | None = None
        self._job: tuple[int, list[WeightBucket], dict] | None = None
        self._sent = 0
        self._verify_requested = False
        self._failure: BaseException | None = None
        self._busy = False
        self._cond = threading.Condition()
        self._closed = False
        self.records: list[dict] = []  # per version: bytes, engines, seconds (sender's thread)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="weight-sender")
        self._thread.start()

    def verify_next(self) -> None:
        """Carry digests with the next update (on demand)."""
        self._verify_requested = True

    def send(self, version: int, buckets: Iterable[WeightBucket]) -> float:
        """Hand `version`'s buckets to the sender's thread and return once the previous version is out (the
        seconds waited for it: 0 when the broadcast kept up). Raises the previous transfer's failure.
        Checksums, when this version carries them, are computed on the sender's thread, not here."""
        buckets = list(buckets)
        verify = self._sent == 0 or self._verify_requested or (self.verify_every and self._sent % self.verify_every == 0)
        self._verify_requested = False
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._failure is not None or (self._job is None and not self._busy),
                                       self.timeout_s):
                raise WeightTransferError(
                    f"the weight sender was still sending version {self._latest[0] if self._latest else '?'} after "
                    f"{self.timeout_s:.0f}s (rollout.weight_timeout_s): an engine stopped receiving")
            self._raise_failure()
            self._job = (version, buckets, {"verify": bool(verify)})
            self._sent += 1
            self._cond.notify_all()
        return time.perf_counter() - start

    def flush(self) -> None:
        """Wait until the last version handed over is delivered to every connected engine (or failed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._failure is not None or (self._job is None and not self._busy),
                                       self.timeout_s):
                raise WeightTransferError(f"weight sender: no delivery within {self.timeout_s:.0f}s "
                                          "(rollout.weight_timeout_s)")
            self._raise_failure()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._groups.clear()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise WeightTransferError(str(self._failure)) from self._failure

    # --- the sender's thread -----------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._job is not None, POLL_S)
                if self._closed:
                    return
                job, self._job = self._job, None
                self._busy = True
            try:
                if job is not None:
                    self._latest = job
                    self._deliver(job, self._connect_new() + list(self._groups))
                else:  # idle: serve engines that joined since the last version
                    joined = self._connect_new()
                    if joined and self._latest is not None:
                        self._deliver(self._latest, joined)
            except BaseException as err:  # the engines hear it from the store; the trainer on its next send
                logger.error("weight sender failed: %s", err)
                with self._cond:
                    self._failure = err
                try:
                    import ray

                    ray.get(self.store.fail_plane.remote(f"{type(err).__name__}: {err}"), timeout=30)
                except Exception:  # the store went with the job: nobody is waiting
                    pass
                return
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _connect_new(self) -> list[str]:
        """Open a group with every engine registered since the last look; their ids."""
        import ray

        endpoints = ray.get(self.store.engines.remote(), timeout=self.timeout_s)
        joined = []
        for engine_id, fields in endpoints.items():
            if engine_id in self._groups:
                continue
            endpoint = Endpoint(engine_id, **fields)
            try:
                group = open_group(endpoint.host, endpoint.port, 0, endpoint.world_size, self.timeout_s)
            except Exception as err:
                raise WeightTransferError(
                    f"could not open the weight group with engine {engine_id} at {endpoint.host}:{endpoint.port} "
                    f"within {self.timeout_s:.0f}s (rollout.weight_timeout_s): {err}") from err
            self._groups[engine_id] = (endpoint, group)
            joined.append(engine_id)
        # engines that left (an actor restarted under a new id, or the pool shrank) are dropped
        for engine_id in [e for e in self._groups if e not in endpoints]:
            del self._groups[engine_id]
        return joined

    def _deliver(self, job: tuple[int, list[WeightBucket], dict], engine_ids: list[str]) -> None:
        """Broadcast one version to the given engines' groups at once, then record each delivery. The
        version's checksums go to the engines that need them: all of them on a verified version, and any
        engine's first delivery (a new or restarted engine is always checked once)."""
        import ray

        version, buckets, flags = job
        engine_ids = list(dict.fromkeys(engine_ids))
        if not engine_ids:
            return
        start = time.perf_counter()
        checked = [e for e in engine_ids if flags["verify"] or e not in self._verified]
        if checked and "digests" not in flags:
            flags["digests"] = digests_of(buckets)
        plain, verified = (encode_layout(layout_of(version, buckets, digests))
                           for digests in (None, flags.get("digests")))
        payload = [bucket_bytes(bucket) for bucket in buckets]
        works = {}
        for engine_id in engine_ids:
            group = self._groups[engine_id][1]
            header, layout = verified if engine_id in checked else plain
            works[engine_id] = post_version(group, header, layout, payload, self.timeout_s)
        failed = {}
        for engine_id, pending in works.items():
            for what, work in zip(["header", "layout"] + [f"bucket {i}" for i in range(len(payload))], pending):
                try:
                    work.wait()
                except Exception as err:
                    failed[engine_id] = (what, err)
                    break
        if failed:
            # An engine that closed (its generate actor's data ran out) leaves the plane before it shuts down, but a
            # version may already be on its way: the broadcast then fails, and is no fault. One still registered died.
            registered = ray.get(self.store.engines.remote(), timeout=self.timeout_s)
            for engine_id, (what, err) in failed.items():
                if engine_id in registered:
                    raise WeightTransferError(
                        f"sending policy version {version} to engine {engine_id}: its {what} was not received "
                        f"within {self.timeout_s:.0f}s (rollout.weight_timeout_s) or its engine died: {err}"
                    ) from err
                logger.info("engine %s left the weight plane during version %d; dropped", engine_id, version)
                self._groups.pop(engine_id, None)
            engine_ids = [e for e in engine_ids if e not in failed]
            checked = [e for e in checked if e not in failed]
        seconds = time.perf_counter() - start
        self._verified.update(checked)
        for engine_id in engine_ids:
            ray.get(self.store.delivered.remote(engine_id, version, engine_id in checked), timeout=self.timeout_s)
        self.records.append({"version": version, "engines": len(engine_ids), "bytes": sum(b.nbytes for b in buckets),
                             "broadcast_s": seconds, "verified": len(checked)})
        del self.records[:-1000]
