"""LoRA on a policy rank (`train.lora`): low-rank adapters injected into the model before DeepSpeed wraps it,
so that only the adapters train and the optimizer holds state for them alone.

The adapters are peft's (`inject_adapter_in_model`, its public low-level API): the model stays the
transformers model it was (its config, its LM head, `gradient_checkpointing_enable` and `save_pretrained`
work as before) with each targeted linear layer replaced by peft's LoRA layer around the original one.

What the engines serve is the trained policy, W + (alpha / r) B A, written out in the base model's own
names by the weight walk (operators/weights/lora_merge.py): every engine, the HF one and vLLM, and every
export load it as they load full weights. The adapters on their own are written beside a checkpoint's
export as peft's adapter folder (`save_adapter`): `PeftModel.from_pretrained(base, folder)` loads them, and
the MLflow adapter model is that folder. Plumbing only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from operators.weights.lora_merge import adapter_weights

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head
INSTALL = "pip install 'streamrl[lora]' (peft==0.21.2)"
ADAPTER_DIR = "adapter"  # in a LoRA checkpoint: the adapters alone, as peft saves them
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class LoraSettings:
    """What `train.lora` asks for: the rank `r`, the scale `alpha` (the update is alpha / r x B A), the dropout
    on the adapters' input, and the linear layers that get an adapter: names matched against the end of each
    module's dotted name (q_proj matches model.layers.0.self_attn.q_proj), or "all-linear"."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR


def peft_missing() -> str | None:
    """None when peft imports, else what to install."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return f"LoRA needs the peft package, which is not installed; install it with {INSTALL}"
    return None


def add_adapters(torch, model, lora: LoraSettings, seed: int):
    """Inject LoRA adapters into `model` in place (only they require gradients afterwards) and return it.
    Seeded here, right before the adapters are made, so that every rank, every ZeRO stage and a plain loop
    start from the same adapter weights whatever building the model drew from the generator."""
    missing = peft_missing()
    if missing:
        raise ImportError(f"train.lora: {missing}")
    from peft import LoraConfig, inject_adapter_in_model

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        bias="none")
    torch.manual_seed(seed)
    try:
        return inject_adapter_in_model(config, model)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"train.lora.target_modules: {err}") from err


def linear_layer_names(model_folder: str, trust_remote_code: bool = False) -> list[str]:
    """The dotted names of the model's linear layers other than its output head, read from its config with
    the model built on the meta device (no weights are read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_folder, local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head]


def unmatched_targets(targets: tuple[str, ...] | str, layer_names: list[str]) -> list[str]:
    """The entries of `targets` that name no layer of `layer_names` (peft's rule for a list: the whole name,
    or its end after a dot)."""
    if isinstance(targets, str):
        return []  # "all-linear": whatever the model has
    return [target for target in targets
            if not any(name == target or name.endswith(f".{target}") for name in layer_names)]


def layer_kinds(layer_names: list[str]) -> list[str]:
    """The distinct last parts of the layers' names, in model order (q_proj, k_proj, ...): what a user puts in
    target_modules."""
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in layer_names))


def save_adapter(module, gathered, base_model: str, rank: int, folder: str) -> str | None:
    """Write `module`'s adapters as peft's adapter folder, folder/adapter: adapter_model.safetensors (the
    adapters' weights in the module's dtype) and adapter_config.json (peft's config as injected, the target
    layers resolved, `base_model_name_or_path` = `base_model`). Every rank calls it under ZeRO-3 (`gathered`:
    DeepSpeed's GatheredParameters, a collective); rank 0 writes and returns the folder, the others None."""
    from safetensors.torch import save_file

    state = {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in adapter_weights(module, gathered)}
    if rank != 0:
        return None
    out = Path(folder) / ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = module.peft_config["default"]  # peft keeps the injected config on the model
    config.base_model_name_or_path, config.inference_mode = base_model, True
    config.save_pretrained(str(out))
    return str(out)


@contextlib.contextmanager
def adapters_disabled(module):
    """Within: `module` computes as its base model, every LoRA layer's adapter off (peft's public
    `enable_adapters`, which also takes the adapters' requires_grad away and gives it back on leaving): the
    reference model of a LoRA run without a second copy of the base weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
