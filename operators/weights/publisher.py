"""The trainer's end of the weight channel: a version's weights packed into buckets in the training dtype,
checked finite, sent to the generators and published to the policy store.

`Publisher` is a part a trainer rank holds (operators/workers/train_worker.py's TrainWorker makes one): it is
given the store, a walk of the weights and the channel's settings when it is made and the policy version
when it publishes, and reads nothing of the rank. It owns the channel's state on the rank: the reused
bucket buffers, the plane's sender (operators/weights/plane.py; made on the first publish) and the last
publish's figures. Plumbing only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from operators.weights.buckets import WeightBucket, non_finite, pack_buckets
from operators.weights.host_buffers import BucketBuffers
from operators.workers.engine_steps import NonFiniteError

if TYPE_CHECKING:
    from operators.weights.plane import WeightSender
    from operators.weights.probe import ServedProbe


class Publisher:
    """Publishes a trainer rank's weights: rank 0 sends them, the other ranks of a ZeRO-3 group take part in
    the gathers."""

    def __init__(self, store, weights: Callable[[], Iterable[tuple[str, Any]]], *, joins: bool,
                 bucket_mb: float, transfer: str, timeout_s: float, verify_every: int,
                 role: str, section: str, pin_memory: bool, probe: ServedProbe | None = None):
        """`store`: the policy store's client (a PolicyStoreClient) on the rank that sends (rank 0), None on
        the others. `weights()`: walks the module's (name, tensor) pairs (under ZeRO-3 a collective). `joins`:
        whether this rank takes part in a publish (rank 0 with a store; every rank under ZeRO-3); a rank that
        does not publishes nothing. `bucket_mb`: the buckets' size; `transfer`: the plane (planes.sender_for:
        "gloo" for the weight plane, operators/weights/gloo_plane.py, or "object_store"); `timeout_s` and
        `verify_every`: the weight plane's longest wait and how often it checksums. `role` and `section` name
        the trainer and its config section in messages. `pin_memory`: page-locked bucket buffers (a GPU rank).
        `probe`: the served-policy probe (operators/weights/probe.py), scored before each version it is due on
        is published; None: no probe (the critic, rollout.probe_every 0)."""
        self.store, self.weights, self.joins = store, weights, joins
        self.bucket_mb, self.transfer = bucket_mb, transfer
        self.timeout_s, self.verify_every = timeout_s, verify_every
        self.role, self.section = role, section
        # Reused from one publish to the next. Pinned on a GPU rank: the device-to-host copies run at DMA
        # speed. On an H200, packing a Qwen2-7B shape's 14.2 GiB of bf16 into reused pinned buffers took
        # 0.30 s, into reused pageable ones 0.99 s (benchmarks/gpu_smoke.py, results/gpu_smoke.json). The
        # price: rank 0 keeps about two versions of the weights page-locked, 2 x 14.2 GiB at 7B.
        self.pin_memory = pin_memory
        self.probe = probe
        self.buffers: BucketBuffers | None = None  # made on the first pack
        self.sender: WeightSender | None = None  # rank 0's sender for the plane, made on the first publish
        self.last_publish: dict = {}  # the last publish's bytes, buckets, dtype (and waited_s on the weight plane)

    def buckets(self) -> Iterator[WeightBucket]:
        """The weights in the training dtype (the module's: bf16 under train.dtype bf16), bucketed."""
        if self.buffers is None:
            self.buffers = BucketBuffers(pin_memory=self.pin_memory)
        return pack_buckets(self.weights(), self.bucket_mb, buffers=self.buffers)

    def publish(self, version: int) -> float:
        """Send `version`'s weights to the generators and publish it; the seconds this rank was held
        (0.0 on a rank that does not join a publish).

        Every rank under ZeRO-3 walks the modules (the gathers are collectives); rank 0 packs the buckets
        in the training dtype and hands them to its plane's sender, which publishes the version: on the weight
        plane (`weight_transfer: gloo`) its thread broadcasts them to the engines while the next step trains
        (operators/weights/gloo_plane.py); otherwise, and for a version an evaluator will read, the buckets go
        to the object store and the store holds their manifest (operators/weights/object_store.py)."""
        if not self.joins:
            return 0.0
        start = time.perf_counter()
        # every joining rank in the same order: under ZeRO-3 the probe's forward is a collective too
        probe = self.probe.measure(version) if self.probe is not None else None
        if self.store is None:  # a ZeRO-3 rank other than 0: take part in the gathers, send nothing
            for _ in self.weights():
                pass
            return time.perf_counter() - start
        buckets = list(self.buckets())
        bad = [name for bucket in buckets for name in non_finite(bucket)]
        if bad:  # never hand NaN weights to the generators (or to a checkpoint)
            raise NonFiniteError(
                f"{self.role} version {version} has non-finite weights ({', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}); it was not published. Resume from the last checkpoint "
                f"with a lower {self.section}.lr or {self.section}.grad_clip"
            )
        if probe is not None:  # in the store before the version is: an engine that applied it finds it there
            self.store.set_probe(version, probe, timeout_s=self.timeout_s)
        nbytes = sum(bucket.nbytes for bucket in buckets)
        self.last_publish = {"bytes": nbytes, "buckets": len(buckets), "dtype": buckets[0].dtype if buckets else ""}
        if self.sender is None:
            from operators.weights.planes import sender_for

            self.sender = sender_for(self.transfer, self.store, self.timeout_s, self.verify_every, name=self.role)
        waited = self.sender.send(version, buckets)  # publishes the version
        if self.transfer == "gloo":
            self.last_publish["waited_s"] = waited  # held for the previous version's broadcast
        return time.perf_counter() - start
