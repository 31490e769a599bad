"""Which plane a sender and a receiver use (operators/weights/plane.py has the protocol)."""

from __future__ import annotations

from operators.weights.gloo_plane import GlooReceiver, GlooSender
from operators.weights.object_store import ObjectStoreReceiver, ObjectStoreSender
from operators.weights.plane import WeightReceiver, WeightSender

PLANES = ("object_store", "gloo")


def receiver_for(store, engine=None) -> WeightReceiver:
    """The receiver for `engine` on `store` (a PolicyStoreClient): the gloo plane's when the engine receives
    on it (`engine.weight_transfer`), else the object store's."""
    if getattr(engine, "weight_transfer", None) == "gloo":
        return GlooReceiver(store, engine)
    return ObjectStoreReceiver(store)


def sender_for(plane: str, store, timeout_s: float = 300.0, verify_every: int = 0, name: str = "trainer") -> WeightSender:
    """The trainer's sender for `plane` (`rollout.weight_transfer` resolved: object_store or gloo)."""
    if plane == "gloo":
        return GlooSender(store, timeout_s, verify_every, name=name)
    if plane == "object_store":
        return ObjectStoreSender(store, verify_every)
    raise ValueError(f"weight plane {plane!r}: use one of {', '.join(PLANES)}")
