"""The gloo plane's wire: one version on one gloo group, from the trainer's sender (rank 0) to an engine's
workers. Used by both sides: operators/weights/gloo_plane.py sends, operators/weights/vllm_gloo.py receives.

Per version and group: an int64 header `[version, layout bytes]`, the layout as UTF-8 JSON (the buckets'
dtypes, names, shapes and byte sizes, and the tensors' sha256 digests when the update is verified), then
each bucket's bytes. Every wait past the header has `timeout_s` and names what it waited for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from operators.weights.buckets import DTYPES, WeightBucket

WIRE_PREFIX = "streamrl-weights"
IDLE_WAIT_S = 7 * 24 * 3600  # an engine waiting for the next version waits as long as the job runs


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


def post_broadcast(group, tensor, timeout_s: float, root: int = 0):
    """Start a broadcast from rank `root` of `group`; the Work to wait on."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = int(root), 0
    options.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def bucket_bytes(bucket: WeightBucket):
    """The bucket's buffer as a flat uint8 torch tensor sharing its memory."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bucket.data).view(np.uint8))


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
    operators.weights.host_buffers.BucketBuffers the buckets are received into, reused once a version is dropped
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
