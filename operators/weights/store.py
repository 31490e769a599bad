"""The policy store: the version gate and the weight planes' registry, a Ray actor behind a typed client.

Every other part of the job holds a `PolicyStoreClient` (made by `PolicyStoreClient.create`, passed in by
whoever built the job: pipelines/recovery/attempts.py) and calls its methods; nobody calls the actor's
remote methods by name. What the store keeps:

* **The version gate.** The latest published policy version; generators wait on it for admission
  (`wait_for_version`, `poll_version`) and trainers publish to it (`publish`).
* **Weights by reference, on the object-store plane** (the HF engine, the critic, versions an evaluator
  reads): the trainer puts the buckets in Ray's object store and publishes their manifest's reference;
  the store keeps only the latest so old versions are freed, except versions named in `retain` (those
  an evaluator will read, pipelines/evaluation/in_training.py): they stay until released.
* **The gloo plane's registry** (vLLM engines, `rollout.weight_transfer: gloo`; operators/weights/
  gloo_plane.py): engines register their rendezvous endpoint (`register_engine`), the trainer's sender
  pushes each version to them and records each delivery (`delivered`), and an engine's rollout loop
  waits for its own (`wait_delivered`). No weights pass through the store there.
* **The load log**: what each in-flight generator reports per update (operators/engines/rollout.py).
* **The served-policy probes**: the trainer's log-probs of a fixed sequence per version (operators/weights/
  probe.py), put before the version is published; each engine compares its own once it applied the version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from operators.weights.plane import WeightTransferError


# Probes kept: an engine reads its version's probe right after applying it, and versions are at most
# max_staleness + 1 behind the newest; more than enough.
PROBES_KEPT = 32


@ray.remote(num_cpus=0)
class PolicyStore:
    """The actor. Its methods are called through `PolicyStoreClient` only."""

    def __init__(self, initial_version: int = 0, retain: tuple[int, ...] = ()):
        # Version `initial_version` is the weights every generator loads from the model folder,
        # so it needs no reference here; only later versions carry weights.
        self.version = initial_version
        self.weights_ref = None
        self.changed = asyncio.Condition()
        self.retain = set(retain)
        self.retained: dict[int, object] = {}  # version -> weights ref, kept for a reader
        self.loads: list[dict] = []  # what in-flight generators report per weight update
        self.endpoints: dict[str, dict] = {}  # the gloo plane: engine id -> its rendezvous endpoint
        self.deliveries: dict[str, int] = {}  # engine id -> newest version its receivers hold
        self.delivered_changed = asyncio.Condition()
        self.plane_failure: str | None = None  # the sender's failure: every engine waiting for a version hears it
        self.probes: dict[int, object] = {}  # version -> the trainer's ProbeRecord (the latest PROBES_KEPT)

    async def publish(self, version: int, weights_ref_box: list) -> None:
        """`weights_ref_box` is `[ref or None]`: boxed so Ray passes the reference, not its value."""
        async with self.changed:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the stored {self.version}")
            self.version, self.weights_ref = version, weights_ref_box[0]
            if version in self.retain:
                self.retained[version] = self.weights_ref
            self.changed.notify_all()

    async def wants_weights(self, version: int) -> bool:
        return version in self.retain

    async def register_engine(self, engine_id: str, endpoint: dict) -> None:
        self.endpoints[engine_id] = dict(endpoint)

    async def unregister_engine(self, engine_id: str) -> None:
        self.endpoints.pop(engine_id, None)

    async def engines(self) -> dict[str, dict]:
        return dict(self.endpoints)

    async def delivered(self, engine_id: str, version: int, verified: bool = False) -> None:
        async with self.delivered_changed:
            self.deliveries[engine_id] = max(version, self.deliveries.get(engine_id, version))
            self.delivered_changed.notify_all()

    async def wait_delivered(self, engine_id: str, min_version: int, timeout_s: float | None = None) -> int | None:
        async with self.delivered_changed:
            try:
                await asyncio.wait_for(self.delivered_changed.wait_for(
                    lambda: self.plane_failure is not None or self.deliveries.get(engine_id, -1) >= min_version),
                    timeout_s)
            except asyncio.TimeoutError:
                return None
            if self.plane_failure is not None:
                raise WeightTransferError(self.plane_failure)
            return self.deliveries[engine_id]

    async def fail_plane(self, message: str) -> None:
        async with self.delivered_changed:
            self.plane_failure = message
            self.delivered_changed.notify_all()

    async def get_version(self) -> int:
        return self.version

    async def wait_for(self, min_version: int, timeout_s: float | None = None) -> int:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= min_version), timeout_s)
            return self.version

    async def poll_version(self, min_version: int, timeout_s: float) -> int | None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= min_version), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self.version

    async def get_latest(self) -> tuple[int, list]:
        return self.version, [self.weights_ref]

    async def get_weights_of(self, version: int, timeout_s: float | None = None) -> list:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= version), timeout_s)
            if version in self.retained:
                return [self.retained[version]]
            if version == self.version:
                return [self.weights_ref]
        raise KeyError(f"policy version {version} was replaced by {self.version} and not retained")

    async def set_probe(self, version: int, record) -> None:
        self.probes[version] = record
        for old in sorted(self.probes)[:-PROBES_KEPT]:
            del self.probes[old]

    async def probe_of(self, version: int):
        return self.probes.get(version)

    async def record_load(self, generator_id: str, record: dict) -> None:
        self.loads.append({"generator_id": generator_id, **record})
        del self.loads[:-10_000]

    async def load_log(self) -> list[dict]:
        return list(self.loads)

    async def release(self, version: int) -> None:
        self.retain.discard(version)
        self.retained.pop(version, None)


@dataclass(frozen=True)
class PolicyStoreClient:
    """The typed way to the store (picklable: it travels to every actor that needs the store).

    Methods ending in `_async` return an awaitable for code on an event loop (the rollout loop); the
    others block."""

    handle: Any  # the PolicyStore actor's handle

    @classmethod
    def create(cls, initial_version: int = 0, retain: tuple[int, ...] = (), **actor_options) -> PolicyStoreClient:
        """Start a store actor (`actor_options`: Ray's, e.g. name and scheduling_strategy)."""
        return cls(PolicyStore.options(**actor_options).remote(initial_version, tuple(retain)))

    # --- the version gate ------------------------------------------------------------------------

    def publish(self, version: int, weights_ref=None) -> None:
        """Publish `version` (newer than the stored one), with the object-store reference of its
        manifest or None (the gloo plane carries the weights)."""
        ray.get(self.handle.publish.remote(version, [weights_ref]))

    def version(self, timeout_s: float | None = None) -> int:
        return ray.get(self.handle.get_version.remote(), timeout=timeout_s)

    def wait_for_version(self, min_version: int, timeout_s: float | None = None) -> int:
        """Block until a version >= min_version is published; the latest. Raises TimeoutError after
        `timeout_s`."""
        return ray.get(self.handle.wait_for.remote(min_version, timeout_s))

    def poll_version_async(self, min_version: int, timeout_s: float):
        """The latest version once one >= min_version exists, or None after `timeout_s`.

        Waiters poll in short calls, never in one call that lasts until the next version: Ray ends an actor
        whose handles were dropped (Ray Data does so to a map actor whose input ran out) only after the calls
        it made return, and SIGKILLs it 5 s later. A call pending until the next version kept the generate
        actor from closing: its engine never left the weight plane, and the trainer's next broadcast failed
        on the dead engine."""
        return self.handle.poll_version.remote(min_version, timeout_s)

    # --- weights by reference (the object-store plane) -----------------------------------------------

    def latest(self) -> tuple[int, Any]:
        """(latest version, its weights reference or None)."""
        version, (ref,) = ray.get(self.handle.get_latest.remote())
        return version, ref

    async def latest_async(self) -> tuple[int, Any]:
        version, (ref,) = await self.handle.get_latest.remote()
        return version, ref

    def weights_of(self, version: int, timeout_s: float | None = None):
        """Wait until `version` is published; its weights reference (None: the model folder's own weights,
        the initial version). Raises KeyError when that version was replaced and not retained."""
        (ref,) = ray.get(self.handle.get_weights_of.remote(version, timeout_s))
        return ref

    def wants_weights(self, version: int) -> bool:
        """Whether `version` must also be put in the object store: an evaluator will read it."""
        return ray.get(self.handle.wants_weights.remote(version))

    def release(self, version: int, wait: bool = False) -> None:
        """Drop a retained version (its reader has it). No reply awaited unless `wait`: calls to an async
        actor may run out of order, so a caller that reads the store next and must see the release waits."""
        ref = self.handle.release.remote(version)
        if wait:
            ray.get(ref)

    # --- the gloo plane's registry -------------------------------------------------------------------

    async def register_engine_async(self, engine_id: str, endpoint: dict) -> None:
        await self.handle.register_engine.remote(engine_id, endpoint)

    def register_engine(self, engine_id: str, endpoint: dict) -> None:
        ray.get(self.handle.register_engine.remote(engine_id, endpoint))

    async def unregister_engine_async(self, engine_id: str) -> None:
        await self.handle.unregister_engine.remote(engine_id)

    def unregister_engine(self, engine_id: str) -> None:
        ray.get(self.handle.unregister_engine.remote(engine_id))

    def engines(self, timeout_s: float | None = None) -> dict[str, dict]:
        """engine id -> rendezvous endpoint, for every engine on the plane now."""
        return ray.get(self.handle.engines.remote(), timeout=timeout_s)

    def delivered(self, engine_id: str, version: int, verified: bool, timeout_s: float | None = None) -> None:
        """The sender's word that `engine_id`'s receivers hold `version`."""
        ray.get(self.handle.delivered.remote(engine_id, version, verified), timeout=timeout_s)

    def wait_delivered_async(self, engine_id: str, min_version: int, timeout_s: float | None = None):
        """Awaitable: the version `engine_id` holds once it is >= min_version, or None after `timeout_s`;
        raises WeightTransferError when the sender failed."""
        return self.handle.wait_delivered.remote(engine_id, min_version, timeout_s)

    def fail_plane(self, message: str, timeout_s: float = 30) -> None:
        """The sender failed (an engine died mid-transfer, a wait timed out): the engines' waits raise it, so
        the attempt ends at once instead of every engine waiting for a version that will not come."""
        ray.get(self.handle.fail_plane.remote(message), timeout=timeout_s)

    # --- the served-policy probes (operators/weights/probe.py) ------------------------------------------

    def set_probe(self, version: int, record, timeout_s: float | None = None) -> None:
        """The trainer's probe record for `version`; waited for, so it is there before the version is published."""
        ray.get(self.handle.set_probe.remote(version, record), timeout=timeout_s)

    def probe_of(self, version: int, timeout_s: float | None = None):
        """The trainer's ProbeRecord for `version`, or None (the probe was not due on it)."""
        return ray.get(self.handle.probe_of.remote(version), timeout=timeout_s)

    async def probe_of_async(self, version: int):
        """The trainer's ProbeRecord for `version`, or None (the probe was not due on it)."""
        return await self.handle.probe_of.remote(version)

    # --- the load log ----------------------------------------------------------------------------------

    def record_load(self, generator_id: str, record: dict) -> None:
        """An in-flight generator loaded a version: its pull, prepare and pause seconds (no reply awaited)."""
        self.handle.record_load.remote(generator_id, record)

    def load_log(self, timeout_s: float | None = None) -> list[dict]:
        return ray.get(self.handle.load_log.remote(), timeout=timeout_s)

    def kill(self) -> None:
        """End the store's actor (the attempt that made it is over)."""
        ray.kill(self.handle)
