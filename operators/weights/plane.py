"""The weight channel's protocol: how a policy version goes from the trainer's rank 0 to the engines.

A **plane** is a pair: a `WeightSender` on the trainer's side and a `WeightReceiver` on each engine's.
The trainer's publisher (operators/weights/publisher.py) packs the weights into buckets
(operators/weights/buckets.py) and hands them to its sender; a generator (operators/stages/generate.py, and the
rollout loop it drives, operators/engines/rollout.py) asks its receiver for the next version and loads
what comes. Both sides meet at the policy store (operators/weights/store.py), which is the version gate
and the planes' registry. Two planes today:

* `object_store` (operators/weights/object_store.py): the buckets become objects in Ray's object store,
  the store holds their manifest; receivers pull them. Any engine (HF, vLLM through a file), the critic,
  evaluators.
* `gloo` (operators/weights/gloo_plane.py, engine side operators/weights/vllm_gloo.py): vLLM's
  weight-transfer API with our gloo engine; the sender broadcasts to every registered engine, whose
  workers stage the bytes; the receiver learns of each delivery from the store and the engine applies
  what its workers staged.

NCCL and CUDA IPC (vLLM's own engines) are the next planes: each is a sender and a receiver with this
shape, picked in operators/weights/planes.py from `rollout.weight_transfer`. vLLM's NCCL engines already run
here with their communicator over gloo (operators/weights/vllm_nccl.py, the trainer ranks' side in
operators/weights/nccl_plane.py, the engine's in operators/engines/weight_sync.py), tested as parts; a job
does not use them yet (docs/deploy.md says what is missing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

if TYPE_CHECKING:
    from operators.weights.buckets import WeightBucket, WeightSet

class WeightTransferError(RuntimeError):
    """A weight transfer failed or timed out; the message names the engine and what was waited for."""


class WeightMismatch(RuntimeError):
    """An engine holds weights other than the trainer's (checksums differ)."""


@dataclass
class Incoming:
    """A policy version a receiver has for its engine.

    `weights`: the version's weights, pulled (the object-store plane), or None when the engine's own
    receivers already staged them (the gloo plane): the engine applies them with `apply_received`.
    `pull_s`: the seconds the pull took (overlapped with decoding on the in-flight path). `digests`: the
    trainer's checksums on a verified version of the object-store plane (the pull already matched them; the
    file an engine writes from the weights is checked against them too), else None. `checked`: the tensors
    whose received bytes were checked."""

    version: int
    weights: WeightSet | None = None
    pull_s: float = 0.0
    digests: dict[str, str] | None = None
    checked: int = 0

    @property
    def staged(self) -> bool:
        return self.weights is None


class WeightSender(Protocol):
    """The trainer's side (rank 0). `send` publishes `version` in the store once its buckets are on their
    way, and returns the seconds the trainer was held waiting for the previous version to go out."""

    def send(self, version: int, buckets: Iterable[WeightBucket]) -> float: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """An engine's side. `next_async(after, timeout_s)`: the newest version newer than `after` once there is
    one, or None after `timeout_s` (short polls: see PolicyStoreClient.poll_version_async). `join_async`
    puts the engine on the plane (a no-op where nothing is pushed to it) and `leave_async` takes it off
    before the engine shuts down."""

    async def join_async(self, name: str, faults) -> None: ...

    async def next_async(self, after: int, timeout_s: float) -> Incoming | None: ...

    async def leave_async(self) -> None: ...
