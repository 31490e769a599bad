"""The object-store plane: a version's buckets as objects in Ray's object store, its manifest in the store.

Rank 0 puts each bucket (an engine reads it zero-copy from its node's store) and publishes a small
`WeightManifest` naming them; the policy store keeps the latest manifest's reference (and those an
evaluator will read). On a verified version (the first, then every `rollout.verify_weights_every`-th) the
manifest carries the trainer's sha256 of every tensor, and a receiver checks the bytes it pulled against
them before its engine sees them (operators/weights/checksums.py). Any engine takes this plane: the HF
engine loads the buckets' tensors, vLLM a safetensors file written from them, the critic's Value stage a state dict. See operators/weights/plane.py
for the protocol; the gloo plane (gloo_plane.py) uses `put_manifest` too, for versions an evaluator reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from operators.weights.buckets import WeightBucket, WeightSet, non_finite
from operators.weights.checksums import differ, digests_of, transport_mismatches, verify_due
from operators.weights.plane import Incoming, WeightMismatch


@dataclass
class WeightManifest:
    """What the policy store holds for a version: where its buckets are and what they hold."""

    transport: str
    dtype: str
    nbytes: int
    tensors: int
    handles: list = field(default_factory=list)  # ObjectStoreTransport: one ObjectRef per bucket
    digests: dict[str, str] | None = None  # a verified version: name -> sha256 of the bytes as they travel


class ObjectStoreTransport:
    """Buckets as objects in Ray's object store (rank 0 puts each as it is filled; an engine reads them
    zero-copy from its node's store)."""

    name = "object_store"

    def send(self, buckets: Iterable[WeightBucket], check_finite: bool = True) -> tuple[WeightManifest, list[str]]:
        """Put every bucket; the manifest and the names of non-finite tensors (nothing is published
        when there are any: the caller drops the manifest and its buckets go with it)."""
        import ray

        refs, bad, nbytes, count, dtypes = [], [], 0, 0, set()
        for bucket in buckets:
            if check_finite:
                bad += non_finite(bucket)
            refs.append(ray.put(bucket))
            nbytes += bucket.nbytes
            count += len(bucket.names)
            dtypes.add(bucket.dtype)
        return WeightManifest(self.name, "+".join(sorted(dtypes)), nbytes, count, refs), bad

    @staticmethod
    def receive(manifest: WeightManifest) -> WeightSet:
        import ray

        return WeightSet(ray.get(list(manifest.handles)))

    @staticmethod
    async def receive_async(manifest: WeightManifest) -> WeightSet:
        import asyncio

        return WeightSet(await asyncio.gather(*manifest.handles))


TRANSPORTS = {ObjectStoreTransport.name: ObjectStoreTransport}


def received(published: Any) -> Any:
    """What a policy store's reference resolved to, ready for an engine: a manifest's WeightSet, or a
    mapping published as is (the simulated trainer's {"version": v}, older records)."""
    if isinstance(published, WeightManifest):
        return TRANSPORTS[published.transport].receive(published)
    return published


async def received_async(published: Any) -> Any:
    if isinstance(published, WeightManifest):
        return await TRANSPORTS[published.transport].receive_async(published)
    return published


def fetch(ref) -> Any:
    """ray.get a policy store's weights reference and receive what it names (see `received`)."""
    import ray

    return received(ray.get(ref))


def put_manifest(buckets: list[WeightBucket], digests: dict[str, str] | None = None):
    """Put the buckets in the object store; the reference of their manifest (what the store keeps), with the
    trainer's `digests` on a verified version."""
    import ray

    manifest = ObjectStoreTransport().send(buckets, check_finite=False)[0]
    manifest.digests = digests
    return ray.put(manifest)


def checked_incoming(version: int, published: Any, weights: Any, pull_s: float) -> Incoming:
    """The version as its engine gets it, after the pulled bytes were checked against the manifest's digests
    (a verified version); WeightMismatch names the tensors that differ."""
    digests = getattr(published, "digests", None)
    if not digests:
        return Incoming(version, weights, pull_s)
    bad = transport_mismatches(weights.buckets, digests)
    if bad:
        raise WeightMismatch(
            f"policy version {version} pulled from the object store does not match the trainer's checksums: "
            f"{differ(bad)}. The attempt stops "
            "rather than sample from weights nobody trained; if it repeats, report it with this message")
    return Incoming(version, weights, pull_s, digests, len(digests))


class ObjectStoreSender:
    """The trainer's side: put the buckets, publish the version with its manifest (and its checksums on the
    first version and every `verify_every`-th: 0 only the first). Nothing runs in the background, so the
    trainer is never held for an earlier version (`send` returns 0 s waited)."""

    def __init__(self, store, verify_every: int = 0):
        self.store = store  # a PolicyStoreClient
        self.verify_every = verify_every
        self.sent = 0

    def send(self, version: int, buckets: Iterable[WeightBucket]) -> float:
        buckets = list(buckets)
        verify = verify_due(self.sent, self.verify_every)
        self.store.publish(version, put_manifest(buckets, digests_of(buckets) if verify else None))
        self.sent += 1
        return 0.0

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class ObjectStoreReceiver:
    """An engine's side: wait for a newer version in the store, then pull its buckets."""

    def __init__(self, store):
        self.store = store  # a PolicyStoreClient

    async def join_async(self, name: str, faults) -> None:
        pass  # nothing is pushed to this engine: it pulls

    async def leave_async(self) -> None:
        pass

    async def next_async(self, after: int, timeout_s: float) -> Incoming | None:
        if await self.store.poll_version_async(after + 1, timeout_s) is None:
            return None
        start = time.perf_counter()
        version, ref = await self.store.latest_async()
        if version <= after or ref is None:
            return None
        published = await ref  # the manifest, then its buckets
        weights = await received_async(published)
        pull_s = time.perf_counter() - start
        if not getattr(published, "digests", None):
            return Incoming(version, weights, pull_s)
        import asyncio  # hashing a whole model takes a while: off the loop that streams the tokens

        return await asyncio.get_running_loop().run_in_executor(
            None, checked_incoming, version, published, weights, pull_s)

    def newest(self, after: int, at_least: int | None = None, timeout_s: float | None = None) -> Incoming | None:
        """Call-synchronous engines (HF, the critic): wait until a version >= `at_least` is published (None:
        do not wait), then pull the latest when it is newer than `after`. The store's TimeoutError after
        `timeout_s` is the admission timeout."""
        latest = self.store.version() if at_least is None else self.store.wait_for_version(at_least, timeout_s)
        if latest <= after:
            return None
        import ray

        start = time.perf_counter()
        version, ref = self.store.latest()
        published = ray.get(ref)
        weights = received(published)
        return checked_incoming(version, published, weights, time.perf_counter() - start)
