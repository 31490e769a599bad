"""Where the job's policy store runs: on the driver's node, under the attempt's name
(operators/weights/store.py is the store and its typed client)."""

from __future__ import annotations

from operators.weights.store import PolicyStoreClient


def create_policy_store(name: str, initial_version: int = 0, retain: tuple[int, ...] = ()) -> PolicyStoreClient:
    """Start a store actor named `name` (named for Ray's dashboard and state API; every part gets the
    client passed in, none looks it up) on the caller's node, and return its client."""
    from pipelines.runtime.placement import on_this_node

    return PolicyStoreClient.create(initial_version, tuple(retain), name=name, scheduling_strategy=on_this_node())
