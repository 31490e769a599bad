"""The policy store: a Ray actor holding the latest policy version, and the weight plane's registry.

Train publishes after every optimizer step. Two ways weights reach generators:

* The weight plane (vLLM engines, `rollout.weight_transfer: gloo`; operators/weight_plane.py): engines
  register their rendezvous endpoint here (`register_engine`), the trainer's sender pushes each version
  to them and records each delivery (`delivered`); an engine's rollout loop waits for its own
  (`wait_delivered`). No weights pass through here.
* The object store (the HF engine, and versions an evaluator reads): the trainer puts the buckets and
  publishes a reference; generators pull when theirs is older. The store keeps only the latest
  reference so old versions are freed, except versions named in `retain` (those an evaluator will read,
  see pipelines/evaluation/in_training.py): they stay until released.
"""

from __future__ import annotations

import asyncio

import ray

from operators.weight_plane import WeightTransferError


@ray.remote(num_cpus=0)
class PolicyStore:
    def __init__(self, initial_version: int = 0, retain: tuple[int, ...] = ()):
        # Version `initial_version` is the weights every generator loads from the model folder,
        # so it needs no reference here; only later versions carry weights.
        self.version = initial_version
        self.weights_ref = None
        self.changed = asyncio.Condition()
        self.publish_times: list[float] = []
        self.retain = set(retain)
        self.retained: dict[int, object] = {}  # version -> weights ref, kept for a reader
        self.loads: list[dict] = []  # what in-flight generators report per weight update (operators/engines/rollout.py)
        self.endpoints: dict[str, dict] = {}  # the weight plane: engine id -> its rendezvous endpoint
        self.deliveries: dict[str, int] = {}  # engine id -> newest version its receivers hold
        self.delivered_changed = asyncio.Condition()
        self.plane_failure: str | None = None  # the sender's failure: every engine waiting for a version hears it

    async def publish(self, version: int, weights_ref_box: list) -> None:
        """`weights_ref_box` is `[ray.put(state_dict)]`: boxed so Ray passes the reference."""
        async with self.changed:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than the stored {self.version}")
            self.version, self.weights_ref = version, weights_ref_box[0]
            if version in self.retain:
                self.retained[version] = self.weights_ref
            self.changed.notify_all()

    async def wants_weights(self, version: int) -> bool:
        """Whether `version` must also be put in the object store: an evaluator will read it."""
        return version in self.retain

    async def register_engine(self, engine_id: str, endpoint: dict) -> None:
        self.endpoints[engine_id] = dict(endpoint)

    async def unregister_engine(self, engine_id: str) -> None:
        self.endpoints.pop(engine_id, None)

    async def engines(self) -> dict[str, dict]:
        return dict(self.endpoints)

    async def delivered(self, engine_id: str, version: int, verified: bool = False) -> None:
        """The sender's word that `engine_id`'s receivers hold `version`."""
        async with self.delivered_changed:
            self.deliveries[engine_id] = max(version, self.deliveries.get(engine_id, version))
            self.delivered_changed.notify_all()

    async def wait_delivered(self, engine_id: str, min_version: int, timeout_s: float | None = None) -> int | None:
        """Block until `engine_id` holds a version >= min_version; that version, or None when `timeout_s` passed
        first (engines poll: see `poll_version`)."""
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
        """The sender failed (an engine died mid-transfer, a wait timed out): the engines' waits raise it, so
        the attempt ends at once instead of every engine waiting for a version that will not come."""
        async with self.delivered_changed:
            self.plane_failure = message
            self.delivered_changed.notify_all()

    async def get_version(self) -> int:
        return self.version

    async def wait_for(self, min_version: int, timeout_s: float | None = None) -> int:
        """Block until a version >= min_version exists; return the latest version."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= min_version), timeout_s)
            return self.version

    async def poll_version(self, min_version: int, timeout_s: float) -> int | None:
        """The latest version once one >= min_version exists, or None after `timeout_s`.

        A generator's weight watcher waits in short polls, never in one call that lasts until the next version:
        Ray ends an actor whose handles were dropped (Ray Data does so to a map actor whose input ran out) only
        after the calls it made return, and SIGKILLs it 5 s later. A call pending until the next version kept
        the generate actor from closing: its engine never left the weight plane, and the trainer's next
        broadcast failed on the dead engine."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= min_version), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self.version

    async def get_latest(self) -> tuple[int, list]:
        return self.version, [self.weights_ref]

    async def get_weights_of(self, version: int, timeout_s: float | None = None) -> list:
        """Wait until `version` is published; its boxed weights ref ([None]: the model folder's own
        weights, version `initial_version` before anything was published). Raises KeyError when
        that version was replaced and not retained."""
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.version >= version), timeout_s)
            if version in self.retained:
                return [self.retained[version]]
            if version == self.version:
                return [self.weights_ref]
        raise KeyError(f"policy version {version} was replaced by {self.version} and not retained")

    async def record_load(self, generator_id: str, record: dict) -> None:
        """An in-flight generator loaded a version: its pull, prepare and pause seconds."""
        self.loads.append({"generator_id": generator_id, **record})
        del self.loads[:-10_000]

    async def load_log(self) -> list[dict]:
        return list(self.loads)

    async def release(self, version: int) -> None:
        """Drop a retained version (its reader has it)."""
        self.retain.discard(version)
        self.retained.pop(version, None)


def create_policy_store(name: str, initial_version: int = 0, retain: tuple[int, ...] = ()):
    """Start the store as a named actor (so operators find it by name) on the caller's node, and return
    its handle."""
    from pipelines.runtime.placement import on_this_node

    return PolicyStore.options(name=name, scheduling_strategy=on_this_node()).remote(initial_version, tuple(retain))
