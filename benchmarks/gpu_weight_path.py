"""The weight plane's wire in one process, for benchmarks/gpu_smoke.py (no Ray on the lent GPU machine):
`LoopbackPlane` (a gloo group of two over a local TCP store), and `weight_path`, the measurement of one
model's weights packed into host buckets, broadcast over it and loaded into a second copy, with pageable
and with pinned host buffers.
"""

from __future__ import annotations

import json
import time


class LoopbackPlane:
    """The weight plane's wire in one process: a gloo group of two (this thread sends as the trainer's rank 0,
    a thread receives as an engine would, operators/weights/vllm_gloo.py) over a local TCP store."""

    def __init__(self, timeout_s: float = 300.0):
        import threading
        from datetime import timedelta

        from torch.distributed import TCPStore

        from operators.weights.gloo_wire import open_group

        self.timeout_s = timeout_s
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        joined = {}
        peer = threading.Thread(target=lambda: joined.setdefault("group", open_group(
            "127.0.0.1", self.store.port, 1, 2, timeout_s)))
        peer.start()
        self.group = open_group("127.0.0.1", self.store.port, 0, 2, timeout_s)
        peer.join()
        self.peer = joined["group"]
        self.receive_buffers = None  # an operators.weights.host_buffers.BucketBuffers the receiving side reuses, as engines do

    def send(self, version: int, buckets: list) -> list:
        """Broadcast `buckets` and return what the receiving side got."""
        from concurrent.futures import ThreadPoolExecutor

        from operators.weights.gloo_wire import bucket_bytes, encode_layout, layout_of, post_version, receive_version

        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(receive_version, self.peer, self.timeout_s, self.timeout_s, None, self.receive_buffers)
            header, layout = encode_layout(layout_of(version, buckets, None))
            for work in post_version(self.group, header, layout, [bucket_bytes(b) for b in buckets], self.timeout_s):
                work.wait()
            _, _, received = got.result(self.timeout_s)
        return received


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_path(shape: dict, plane: LoopbackPlane, rounds: int) -> dict:
    """Pack, broadcast and load one model's weights (bf16, no trainer) with pageable and pinned host buffers."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from operators.weights.host_buffers import BucketBuffers
    from operators.weights.buckets import DEFAULT_BUCKET_MB, WeightSet, named_weights, pack_buckets

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = Qwen2Config(**shape)
    start = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.no_grad():
            source = Qwen2ForCausalLM(config).eval()
            target = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in source.state_dict().values())
    report = {"model": shape, "bytes": nbytes, "bucket_mb": DEFAULT_BUCKET_MB,
              "build_s": time.perf_counter() - start, "rounds": []}
    print(f"weight path: {nbytes / 2**30:.2f} GiB in bf16 on {device}, built in {report['build_s']:.1f} s", flush=True)
    version = 100
    for pin in ((False, True) if cuda else (False,)):
        buffers = BucketBuffers(pin_memory=pin)
        plane.receive_buffers = BucketBuffers(pin_memory=pin)
        for round_ in range(rounds):
            version += 1
            with torch.no_grad():  # so that equal_to_source says this round's load wrote every tensor
                for tensor in target.state_dict().values():
                    tensor.zero_()
            synchronize()
            start = time.perf_counter()
            buckets = list(pack_buckets(named_weights(source), DEFAULT_BUCKET_MB, buffers=buffers))
            packed = time.perf_counter()
            received = plane.send(version, buckets)
            sent = time.perf_counter()
            with torch.no_grad():
                target.load_state_dict(WeightSet(received).state_dict(), strict=True)
            synchronize()
            loaded = time.perf_counter()
            same = all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
            parts = {"pack_s": packed - start, "broadcast_s": sent - packed, "apply_s": loaded - sent}
            row = {"pinned": pin, "round": round_, "total_s": loaded - start, **parts,
                   **{k.replace("_s", "_gb_per_s"): nbytes / v / 1e9 for k, v in parts.items()},
                   "equal_to_source": same}
            report["rounds"].append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            del buckets, received
        plane.receive_buffers = None
        del buffers
    del source, target
    if cuda:
        torch.cuda.empty_cache()
    return report
