"""The weights of a model trained with LoRA adapters (operators/workers/lora.py), as the engines load them: the
base model's state-dict names, each adapted linear layer's weight W + (alpha / r) B A, no adapter entries
(`merged_weights`); or the adapters alone, in peft's saved names, for engines that serve each version as an
adapter (`adapter_weights`).

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


def peft_saved_name(name: str) -> str:
    """A LoRA parameter's name in the module (model.layers.0.mlp.up_proj.lora_A.default.weight) as peft saves it
    (base_model.model.model.layers.0.mlp.up_proj.lora_A.weight: the PeftModel's prefix, no adapter name)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def module_adapter_name(saved: str) -> str:
    """peft's saved name back to the module's (the inverse of peft_saved_name)."""
    name = saved.removeprefix("base_model.model.")
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, f"{part}{ADAPTER}.")
    return name


def adapter_weights(module, gathered=None) -> Iterator[tuple[str, Any]]:
    """The adapters alone, lora_A and lora_B of every adapted layer in peft's saved names, one layer at a time
    (gathered together under ZeRO-3)."""
    from peft.tuners.lora import LoraLayer

    for prefix, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        own = [(f"{prefix}.{name}", param) for name, param in sub.named_parameters() if ".lora_" in f".{name}"]
        with gathering(gathered, [param for _, param in own]):
            for name, param in own:
                yield peft_saved_name(name), param.detach()
