"""The trainer's weights as a weight source: what vLLM's trainer-side weight-transfer engines (NCCL, IPC:
vllm/distributed/weight_transfer/base.py `WeightSource`) take from a trainer, without vLLM.

Two channels that must agree element for element (vLLM's dense NCCL engine sizes the receivers' buffers from
the first and sends the bytes of the second):

- `metadata()`: (name, dtype, full shape) of every entry the walk will yield, from the parameters as they are,
  with nothing gathered: under ZeRO-3 a partitioned parameter's full shape is its `ds_shape` (its own `shape`
  is the empty local placeholder), and a LoRA layer is the base layer's weight (and bias) under the base names,
  as lora_merge.merged_weights yields it;
- iteration: the walk itself (buckets.named_weights or lora_merge.merged_weights), a fresh pass each time,
  one module gathered at a time on every rank (a collective: every rank iterates in lockstep).

`vllm_weight_source` wraps it in vLLM's own class where vLLM is installed. Nothing here moves a byte.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from operators.weights.buckets import module_entries


def full_shape(tensor) -> tuple[int, ...]:
    """A tensor's whole shape: ZeRO-3's `ds_shape` for a partitioned parameter, else its own."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def weight_metadata(module, lora: bool = False) -> list[tuple[str, Any, tuple[int, ...]]]:
    """(name, dtype, full shape) of each entry the weight walk of `module` yields, in its order, with nothing
    gathered. `lora`: the walk is lora_merge.merged_weights (adapted layers under the base names)."""
    keys = set(module.state_dict(keep_vars=True).keys())
    out: list[tuple[str, Any, tuple[int, ...]]] = []
    layer = None
    if lora:
        from peft.tuners.lora import LoraLayer

        layer = LoraLayer
    adapted = None
    for prefix, sub in module.named_modules():
        if adapted is not None and prefix.startswith(adapted):
            continue
        if layer is not None and isinstance(sub, layer):
            adapted = f"{prefix}."
            base = sub.get_base_layer()
            out.append((f"{prefix}.weight", base.weight.dtype, full_shape(base.weight)))
            if getattr(base, "bias", None) is not None:
                out.append((f"{prefix}.bias", base.bias.dtype, full_shape(base.bias)))
            continue
        out += [(name, tensor.dtype, full_shape(tensor)) for name, tensor in module_entries(prefix, sub, keys)]
    return out


class TrainerWeights:
    """`metadata()` and iteration over one trainer rank's weights (see the module docstring). `walk()`: a fresh
    pass of the weight walk (the rank's `_named_weights`); `lora`: the walk merges LoRA adapters."""

    def __init__(self, module, walk: Callable[[], Iterator[tuple[str, Any]]], lora: bool = False):
        self.module, self.walk, self.lora = module, walk, lora
        self._metadata = None

    def metadata(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        if self._metadata is None:  # shapes and names do not change while a job trains
            self._metadata = weight_metadata(self.module, self.lora)
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.walk())


def vllm_weight_source(weights: TrainerWeights):
    """`weights` as vLLM's WeightSource (vllm/distributed/weight_transfer/base.py), for its trainer-side engines."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in weights.metadata()]

        def __iter__(self):
            return iter(weights)

    return Source()
