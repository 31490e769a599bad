"""Checksums of a policy version: what proves that an engine holds the weights the trainer sent.

The trainer's sender computes a sha256 per tensor, of the bytes as they travel (the training dtype), for a
verified update: the first version and every `rollout.verify_weights_every`-th. An engine's receiver checks the
bytes it got (`transport_mismatches`). On the gloo plane (operators/weights/gloo_plane.py, vllm_gloo.py) the
engine then checks the tensors its model keeps as the trainer sent them (`applied_mismatches`); on the
object-store plane (operators/weights/object_store.py, the digests in the version's manifest) vLLM loads a
file written from the received bytes, full weights or a LoRA adapter's folder, and the rollout loop checks
that file before the engine loads it (`file_mismatches`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Iterable

import numpy as np

from operators.weights.buckets import WeightBucket


def verify_due(sent: int, verify_every: int) -> bool:
    """Whether the version after `sent` earlier ones carries checksums: the first, then every `verify_every`-th
    (0: the first only)."""
    return sent == 0 or bool(verify_every and sent % verify_every == 0)


def differ(bad: list[str]) -> str:
    """'N tensors differ (the first four names ...)', for a mismatch's message."""
    return f"{len(bad)} tensors differ ({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''})"


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()


def digests_of(buckets: Iterable[WeightBucket]) -> dict[str, str]:
    """name -> sha256 of the tensor's bytes as they travel (the training dtype)."""
    return {name: digest(array) for bucket in buckets for name, array in bucket.arrays()}


def transport_mismatches(buckets: list[WeightBucket], digests: dict[str, str]) -> list[str]:
    """Names whose received bytes differ from the trainer's digest (or that did not arrive)."""
    got = digests_of(buckets)
    return [f"{name} (received)" for name, expected in digests.items() if got.get(name) != expected]


def file_mismatches(path: str, digests: dict[str, str]) -> tuple[int, list[str]]:
    """Compare the tensors of a safetensors file (or of a LoRA adapter folder's adapter_model.safetensors) with
    the trainer's digests, byte for byte as stored: (checked count, mismatching or missing names)."""
    if os.path.isdir(path):
        path = os.path.join(path, "adapter_model.safetensors")
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        base, bad, checked = 8 + size, [], 0
        for name, expected in digests.items():
            entry = header.get(name)
            if entry is None:
                bad.append(f"{name} (written)")
                continue
            start, end = entry["data_offsets"]
            f.seek(base + start)
            checked += 1
            if hashlib.sha256(f.read(end - start)).hexdigest() != expected:
                bad.append(f"{name} (written)")
    return checked, bad


def applied_mismatches(model, digests: dict[str, str], dtypes: dict[str, str],
                       shapes: dict[str, tuple] | None = None) -> tuple[int, list[str]]:
    """Compare the model's tensors that vLLM keeps as the trainer sent them with the trainer's digests, each
    cast to the dtype it travelled in: every 1-D parameter (norms, biases) and the embedding and head
    tables when their shape is the trainer's (vLLM pads a vocabulary to a multiple of 64). Linear weights
    are not compared: vLLM fuses q/k/v and gate/up, and its CPU backend repacks every linear weight for
    its kernels. (checked count, mismatching names)."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tables = {f"{prefix}.weight" if prefix else "weight" for prefix, module in model.named_modules()
              if isinstance(module, VocabParallelEmbedding)}
    checked, bad = 0, []
    for name, param in model.named_parameters():
        expected = digests.get(name)
        if expected is None or name not in dtypes or not (param.dim() == 1 or name in tables):
            continue
        if shapes is not None and tuple(param.shape) != tuple(shapes.get(name, ())):
            continue
        tensor = param.detach().to("cpu", dtype=getattr(torch, dtypes[name])).contiguous()
        if dtypes[name] == "bfloat16":
            tensor = tensor.view(torch.int16)
        checked += 1
        if digest(tensor.numpy()) != expected:
            bad.append(f"{name} (applied)")
    return checked, bad
