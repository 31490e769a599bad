"""The weights of a model trained with LoRA adapters (operators/workers/lora.py), as the engines load them: the
base model's state-dict names, each adapted linear layer's weight W + (alpha / r) B A, no adapter entries.

The walk goes one module at a time as `named_weights` (buckets.py) does: under ZeRO-3 an adapted layer's base
weight and both adapter matrices are gathered together for the duration, so no rank holds more than one
layer whole. The merged weight is a new tensor; the module's own weights are never changed (merging in place
and back would drift the frozen base by float rounding, step after step).
"""

from __future__ import annotations

from typing import Any, Iterator

from operators.weights.buckets import gathering, module_entries

ADAPTER = "default"  # peft's name for the one adapter a rank trains


def merged_weights(module, gathered=None) -> Iterator[tuple[str, Any]]:
    """Every entry of the base model's state dict (tied weights under each name), the adapted layers' weights
    merged. `gathered(params)`: deepspeed.zero.GatheredParameters under ZeRO-3, None otherwise."""
    from peft.tuners.lora import LoraLayer

    keys = set(module.state_dict(keep_vars=True).keys())
    adapted = None  # the prefix of the adapted layer whose parts are being skipped over
    for prefix, sub in module.named_modules():
        if adapted is not None and prefix.startswith(adapted):
            continue  # the parts of an adapted layer (its base layer, lora_A, lora_B, dropout): done with it
        if isinstance(sub, LoraLayer):
            adapted = f"{prefix}."
            with gathering(gathered, list(sub.parameters())):
                base = sub.get_base_layer()
                delta = sub.get_delta_weight(ADAPTER).to(base.weight.dtype)
                yield f"{prefix}.weight", (base.weight + delta).detach()
                if getattr(base, "bias", None) is not None:
                    yield f"{prefix}.bias", base.bias.detach()
            continue
        own = module_entries(prefix, sub, keys)
        if own:
            with gathering(gathered, [tensor for _, tensor in own]):
                for name, tensor in own:
                    yield name, tensor.detach()
