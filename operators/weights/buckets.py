"""A trainer's weights, in its training dtype, in buckets: what every weight plane carries.

A publish walks the model one module at a time (`named_weights`): under ZeRO-3 each module's own
parameters are gathered, copied into the current bucket and released before the next module is
gathered, so no rank ever holds more than one module's full weights on its device. A bucket is one
flat host buffer of at most `bucket_mb` (one dtype: bf16 stays bf16, two bytes a weight), filled into
reused host buffers (operators/weights/host_buffers.py) and handed to the plane's sender as soon as it
is full (operators/weights/plane.py: the planes; operators/weights/object_store.py and gloo_plane.py).

The engines take a `WeightSet` or, for plain loops and tests, a mapping of names to arrays
(`as_weight_set`). vLLM reads a safetensors file (operators/engines/vllm.py); `WeightSet.write_safetensors`
writes the buckets' buffers into one without converting them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import numpy as np

if TYPE_CHECKING:
    from operators.weights.host_buffers import BucketBuffers

DEFAULT_BUCKET_MB = 256

# torch dtype name -> (safetensors code, numpy storage dtype, bytes per element). bf16 has no numpy
# dtype: its buffer is stored as uint16 and viewed as torch.bfloat16 again on the way out.
DTYPES = {
    "float32": ("F32", np.float32, 4),
    "bfloat16": ("BF16", np.uint16, 2),
    "float16": ("F16", np.float16, 2),
    "float64": ("F64", np.float64, 8),
    "int64": ("I64", np.int64, 8),
    "int32": ("I32", np.int32, 4),
    "bool": ("BOOL", np.bool_, 1),
}


def dtype_bytes(dtype: str) -> int:
    return DTYPES[dtype][2]


@dataclass
class WeightBucket:
    """Tensors of one dtype packed end to end in one flat host buffer (`data`, numpy, 1-D)."""

    dtype: str  # a key of DTYPES
    names: list[str]
    shapes: list[tuple[int, ...]]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def arrays(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, view of `data` in its shape); bf16 views are uint16 (see DTYPES)."""
        offset = 0
        for name, shape in zip(self.names, self.shapes):
            count = math.prod(shape)
            yield name, self.data[offset:offset + count].reshape(shape)
            offset += count

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, torch tensor) sharing `data` (read-only buffers from the object store included)."""
        import warnings

        import torch

        with warnings.catch_warnings():  # object-store buffers are read-only; every consumer copies
            warnings.simplefilter("ignore", UserWarning)
            for name, array in self.arrays():
                tensor = torch.from_numpy(array)
                yield name, tensor.view(torch.bfloat16) if self.dtype == "bfloat16" else tensor


class WeightSet:
    """One policy version's weights as buckets, the way an engine receives them."""

    def __init__(self, buckets: Iterable[WeightBucket]):
        self.buckets = list(buckets)

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    def names(self) -> list[str]:
        return [name for bucket in self.buckets for name in bucket.names]

    def tensors(self) -> Iterator[tuple[str, Any]]:
        for bucket in self.buckets:
            yield from bucket.tensors()

    def state_dict(self) -> dict[str, Any]:
        """name -> torch tensor (views of the buckets: load_state_dict copies and casts them)."""
        return dict(self.tensors())

    def float32_arrays(self) -> dict[str, np.ndarray]:
        """name -> float32 numpy copy (for checks and for consumers that want fp32 host arrays)."""
        return {name: tensor.float().numpy().copy() for name, tensor in self.tensors()}

    def write_safetensors(self, path: str) -> None:
        """One safetensors file holding every bucket, buffers written as they are (no conversion)."""
        header: dict[str, Any] = {}
        offset = 0
        for bucket in self.buckets:
            code, _, size = DTYPES[bucket.dtype]
            for name, shape in zip(bucket.names, bucket.shapes):
                end = offset + math.prod(shape) * size
                header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
                offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the format pads its header to 8 bytes
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for bucket in self.buckets:
                out.write(memoryview(np.ascontiguousarray(bucket.data)).cast("B"))


def as_weight_set(weights: WeightSet | Mapping[str, Any]) -> WeightSet:
    """A WeightSet as is; a mapping of names to numpy arrays or torch tensors (a plain loop's
    `state_dict()`, a test) as one bucket per dtype."""
    if isinstance(weights, WeightSet):
        return weights
    return WeightSet(pack_buckets(((name, _as_torch(value)) for name, value in weights.items()), bucket_mb=None))


def _as_torch(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(value))


def torch_dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _Packer:
    """Copies tensors of one dtype into host buffers of `capacity` bytes (None: one buffer for all,
    joined at the end); yields each full bucket. A tensor is copied once, from wherever it lives
    (a GPU, a gathered ZeRO-3 parameter) straight into its place in the buffer, so the caller may
    release it right after `add` returns."""

    def __init__(self, dtype: str, capacity: int | None, buffers: BucketBuffers | None = None):
        self.dtype, self.capacity, self.buffers = dtype, capacity, buffers
        self._reset()

    def _reset(self) -> None:
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.parts: list[Any] = []  # capacity None: host copies, joined at flush
        self.buffer = None  # capacity set: the bucket's flat host buffer (torch, this dtype)
        self.slot = None  # the BucketBuffers slot the buffer came from, if any
        self.count = 0  # elements written

    def add(self, name: str, tensor) -> WeightBucket | None:
        import torch

        full = None
        size = dtype_bytes(self.dtype)
        elements = tensor.numel()
        if self.capacity is None:
            self.parts.append(tensor.detach().reshape(-1).to("cpu", dtype=_torch_dtype(self.dtype), copy=True))
        else:
            if self.names and (self.count + elements) * size > self.capacity:
                full = self.flush()
            if self.buffer is None:  # a tensor larger than a bucket gets a bucket of its own size
                needed = max(self.capacity // size, elements)
                if self.buffers is None:
                    self.buffer = torch.empty(needed, dtype=_torch_dtype(self.dtype))
                else:
                    self.slot = self.buffers.take(_torch_dtype(self.dtype), needed)
                    self.buffer = self.slot.buffer
            self.buffer[self.count:self.count + elements].copy_(tensor.detach().reshape(-1))  # casts to the bucket's dtype
        self.names.append(name)
        self.shapes.append(tuple(tensor.shape))
        self.count += elements
        return full

    def flush(self) -> WeightBucket | None:
        if not self.names:
            return None
        import torch

        if self.capacity is None:
            flat = torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]
        else:
            flat = self.buffer[:self.count]
        if self.dtype == "bfloat16":
            flat = flat.view(torch.int16)
        root = flat.contiguous().numpy()  # every numpy view made from the bucket keeps this array alive
        data = root.view(DTYPES[self.dtype][1])
        if self.slot is not None:
            self.slot.hand_out(root)
        bucket = WeightBucket(self.dtype, self.names, self.shapes, data)
        self._reset()
        return bucket

    def abandon(self) -> None:
        """Give back the buffer of a bucket that will not be finished (the pack failed or was stopped)."""
        if self.slot is not None:
            self.slot.release()
        self._reset()


def pack_buckets(named: Iterable[tuple[str, Any]], bucket_mb: float | None = DEFAULT_BUCKET_MB,
                 dtype: str | None = None, buffers: BucketBuffers | None = None) -> Iterator[WeightBucket]:
    """Buckets of at most `bucket_mb` (None: one per dtype) from (name, torch tensor) pairs, in order.
    `dtype` casts floating tensors to it (integer and bool buffers keep theirs). Each tensor is copied
    to the host as it arrives, so the caller may release it (a ZeRO-3 gather) right after. `buffers`:
    where bucket buffers come from and go back to between publishes (with `bucket_mb` set)."""
    capacity = None if bucket_mb is None else max(int(bucket_mb * 2**20), 1)
    packers: dict[str, _Packer] = {}
    try:
        for name, tensor in named:
            kind = dtype if (dtype is not None and tensor.is_floating_point()) else torch_dtype_name(tensor)
            if kind not in DTYPES:
                raise TypeError(f"weight {name}: dtype {kind} cannot travel the weight channel ({', '.join(DTYPES)})")
            full = packers.setdefault(kind, _Packer(kind, capacity, buffers)).add(name, tensor)
            if full is not None:
                yield full
        for packer in packers.values():
            last = packer.flush()
            if last is not None:
                yield last
    finally:  # a failed or abandoned pack gives its unfinished buckets' buffers back (a no-op after a full pack)
        for packer in packers.values():
            packer.abandon()


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def named_weights(module, gathered=None) -> Iterator[tuple[str, Any]]:
    """Every entry of `module.state_dict()` (same names, tied weights under each name), one module at a
    time. `gathered(params)`: a context manager that makes a module's own parameters whole for the
    duration (deepspeed.zero.GatheredParameters under ZeRO-3; None: they already are)."""
    keys = set(module.state_dict(keep_vars=True).keys())
    for prefix, sub in module.named_modules():
        own = module_entries(prefix, sub, keys)
        if own:
            with gathering(gathered, [tensor for _, tensor in own]):
                for name, tensor in own:
                    yield name, tensor.detach()


def module_entries(prefix: str, sub, keys: set[str]) -> list[tuple[str, Any]]:
    """The state-dict entries (`keys`) among the own parameters and buffers of the module `sub` at `prefix`."""
    own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub.named_parameters(recurse=False, remove_duplicate=False)]
    own += [(f"{prefix}.{n}" if prefix else n, b) for n, b in sub.named_buffers(recurse=False, remove_duplicate=False)]
    return [(name, tensor) for name, tensor in own if name in keys]


def gathering(gathered, tensors: list):
    """`gathered(params)` over the parameters among `tensors` (made whole for the duration under ZeRO-3), or a
    context that does nothing (no `gathered`, or no parameter)."""
    import contextlib

    import torch

    params = [tensor for tensor in tensors if isinstance(tensor, torch.nn.Parameter)]
    return gathered(params) if (gathered is not None and params) else contextlib.nullcontext()


def non_finite(bucket: WeightBucket) -> list[str]:
    """Names of the bucket's tensors holding a NaN or an infinity."""
    if bucket.dtype in ("int64", "int32", "bool"):
        return []
    if bucket.dtype == "bfloat16":  # exponent bits all ones: inf or NaN
        return [name for name, array in bucket.arrays() if ((array & 0x7F80) == 0x7F80).any()]
    return [name for name, array in bucket.arrays() if not np.isfinite(array).all()]
