"""The gloo plane: a trainer's weights pushed to every vLLM engine over a collective, no files, no object store.

vLLM 0.32's weight-transfer API is the engine side: `AsyncLLM.init_weight_transfer_engine`, then per update
`start_weight_update` / `update_weights` / `finish_weight_update(weight_version)`, each run by a
`WeightTransferEngine` in every vLLM worker. The backend is chosen by `rollout.weight_transfer`:

* `gloo` (CPUs, CI): our engine, `operators/weights/vllm_gloo.py`, registered through vLLM's
  `WeightTransferEngineFactory`. The bytes travel over torch.distributed gloo.
* `nccl` / `ipc` (GPUs): vLLM's own engines, selected by the same config; not run here (no GPU).

One update, as this module's `GlooSender` drives it on the trainer's rank 0:

1. The trainer ranks gather the weights module by module into host buckets in the training dtype
   (operators/weights/buckets.py `pack_buckets`; ZeRO-3 gathers are collectives, so every rank takes part).
   That is all the trainer ranks wait for: `send` hands the buckets to the sender's thread and returns.
2. The sender's thread broadcasts them to every registered engine at once: one gloo group per engine
   (trainer rank 0 and that engine's workers), all groups' broadcasts posted before any is awaited.
   Each engine's workers receive in a thread of their own while the engine goes on decoding.
3. When an engine's group has the whole version, the sender records the delivery in the policy store
   (`delivered`). The engine's rollout loop, waiting for it, pauses decoding only to apply the staged
   weights (start / update / finish), confirms the version and resumes.

The wire format is operators/weights/gloo_wire.py's.

Engines join at any time (a restart, an autoscaled actor): each one registers its rendezvous endpoint
with the policy store; the sender connects it before the next update and, when idle, at once, and sends
it the latest version, which it keeps (host memory, one copy: what the object store used to hold).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Iterable

from operators.weights.buckets import WeightBucket
from operators.weights.checksums import digests_of, verify_due
from operators.weights.gloo_wire import Endpoint, bucket_bytes, encode_layout, layout_of, open_group, post_version
from operators.weights.object_store import put_manifest
from operators.weights.plane import Incoming, WeightTransferError

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often an idle sender looks for engines that joined


class GlooSender:
    """Trainer rank 0's side of the gloo plane (see the module docstring; operators/weights/plane.py's
    WeightSender).

    `store`: a PolicyStoreClient (engines register there; deliveries are recorded there).
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
        """Hand `version`'s buckets to the sender's thread once the previous version is out, then publish the
        version in the store (in the object store too when an evaluator will read it); the seconds waited
        for the previous version (0 when the broadcast kept up). Raises the previous transfer's failure.
        Checksums, when this version carries them, are computed on the sender's thread, not here."""
        buckets = list(buckets)
        waited = self.hand_over(version, buckets)
        self.store.publish(version, put_manifest(buckets) if self.store.wants_weights(version) else None)
        return waited

    def hand_over(self, version: int, buckets: Iterable[WeightBucket]) -> float:
        """Hand `version`'s buckets to the sender's thread once the previous version is out; the seconds
        waited. Publishes nothing (tests drive the wire alone with it)."""
        buckets = list(buckets)
        verify = self._verify_requested or verify_due(self._sent, self.verify_every)
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
                    self.store.fail_plane(f"{type(err).__name__}: {err}")
                except Exception:  # the store went with the job: nobody is waiting
                    pass
                return
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _connect_new(self) -> list[str]:
        """Open a group with every engine registered since the last look; their ids."""
        endpoints = self.store.engines(timeout_s=self.timeout_s)
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
            registered = self.store.engines(timeout_s=self.timeout_s)
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
            self.store.delivered(engine_id, version, engine_id in checked, timeout_s=self.timeout_s)
        self.records.append({"version": version, "engines": len(engine_ids), "bytes": sum(b.nbytes for b in buckets),
                             "broadcast_s": seconds, "verified": len(checked)})
        del self.records[:-1000]


class GlooReceiver:
    """An engine's side of the gloo plane (operators/weights/plane.py's WeightReceiver): the engine's workers
    receive each version as it is broadcast (operators/weights/vllm_gloo.py); this learns from the store
    that they hold it, and the engine applies it (`Incoming.staged`)."""

    def __init__(self, store, engine):
        self.store, self.engine = store, engine  # a PolicyStoreClient; an engine with `join_weight_plane`
        self.engine_id: str | None = None

    async def join_async(self, name: str, faults) -> None:
        """Open the engine's rendezvous, start its workers' receivers and register it: the trainer's sender
        connects and sends it the latest version."""
        engine_id = f"{name}:{uuid.uuid4().hex[:8]}"
        endpoint = await self.engine.join_weight_plane(engine_id, faults)
        await self.store.register_engine_async(engine_id, endpoint)
        self.engine_id = engine_id

    async def next_async(self, after: int, timeout_s: float) -> Incoming | None:
        version = await self.store.wait_delivered_async(self.engine_id, after + 1, timeout_s)
        return None if version is None else Incoming(int(version))

    async def leave_async(self) -> None:
        """Leave the plane first, so the trainer's sender stops sending here."""
        if self.engine_id is not None:
            await self.store.unregister_engine_async(self.engine_id)
