"""The CUDA IPC round trip for benchmarks/gpu_smoke.py (issue 45, item 3): a model's weights, made on this
process's GPU, reach a second process through IPC handles, as vLLM's IPC weight-transfer engine ships them
(`torch.multiprocessing.reductions.reduce_tensor` on the sender, the rebuild function it names on the
receiver; vllm/distributed/weight_transfer/ipc_engine.py), with torch alone.

What it checks: every tensor the receiver rebuilds equals the sender's (a float64 sum and the first and last
elements each), on the receiver's GPU; and the memory is shared, not copied: the sender changes a tensor in
place after the rebuild and the receiver sees the change. What it times: the export of the handles, their
trip and the rebuild of every tensor on the other side.

On a CPU the same code runs over shared memory (reduce_tensor moves a CPU tensor's storage there and passes
its file descriptor), so CI keeps the script from rotting; only a GPU run says anything about CUDA IPC.
"""

from __future__ import annotations

import json
import time

PROCESS_TIMEOUT_S = 300.0


def fingerprint(tensor) -> tuple[float, float, float]:
    """A tensor's float64 sum and its first and last elements: equal on both sides of a shared memory."""
    flat = tensor.reshape(-1)
    return (float(flat.double().sum()), float(flat[0].double()), float(flat[-1].double()))


def receiver(inbox, outbox) -> None:
    """The second process: rebuild each tensor from its handle, answer its fingerprint; re-read on request."""
    import torch

    tensors = []
    while True:
        kind, payload = inbox.get()
        if kind == "stop":
            return
        if kind == "map":
            start = time.perf_counter()
            tensors = [rebuild(*args) for rebuild, args in payload]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rebuilt_s = time.perf_counter() - start
            outbox.put({"rebuild_s": rebuilt_s, "device": str(tensors[0].device),
                        "fingerprints": [fingerprint(t) for t in tensors]})
        elif kind == "read":
            outbox.put({"fingerprint": fingerprint(tensors[payload])})


def ipc_round_trip(shape: dict, rounds: int = 2) -> dict:
    """Round trips of a model's weights (bf16, shape `shape`: a Qwen2 config's fields) to a spawned process."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.no_grad():
            model = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    finally:
        torch.set_default_dtype(default)
    tensors = [t.contiguous() for t in model.state_dict().values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    inbox, outbox = context.Queue(), context.Queue()
    child = context.Process(target=receiver, args=(inbox, outbox), daemon=True)
    child.start()
    report = {"model": shape, "bytes": nbytes, "tensors": len(tensors), "device": str(device), "rounds": []}
    print(f"ipc round trip: {nbytes / 2**30:.2f} GiB in {len(tensors)} tensors on {device}", flush=True)
    try:
        for round_ in range(rounds):
            start = time.perf_counter()
            handles = [reduce_tensor(t) for t in tensors]
            exported = time.perf_counter()
            inbox.put(("map", handles))
            answer = outbox.get(timeout=PROCESS_TIMEOUT_S)
            mapped = time.perf_counter()
            equal = answer["fingerprints"] == [fingerprint(t) for t in tensors]
            with torch.no_grad():  # shared, not copied: a change made here after the rebuild is seen there
                tensors[0].add_(1.0)
            if cuda:
                torch.cuda.synchronize()
            inbox.put(("read", 0))
            seen = outbox.get(timeout=PROCESS_TIMEOUT_S)["fingerprint"] == fingerprint(tensors[0])
            row = {"round": round_, "export_s": exported - start, "trip_and_rebuild_s": mapped - exported,
                   "rebuild_s": answer["rebuild_s"], "receiver_device": answer["device"],
                   "equal_to_source": equal, "change_seen_by_receiver": seen}
            report["rounds"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        inbox.put(("stop", None))
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    return report

