"""A trainer rank's resumable state and its exports: DeepSpeed engine checkpoints with the rank's RNG states,
the full weights as a state dict, and the Hugging Face export.

`Checkpointer` is a part the rank holds (operators/workers/train_worker.py's TrainWorker makes one); it is
given what it uses when it is made and the policy version when it saves, and reads nothing of the rank.
Plumbing only.
"""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np


class Checkpointer:
    """Checkpoints, RNG states, full state dicts and the HF export of one trainer rank."""

    def __init__(self, engine, torch, rank: int, weights: Callable[[], Iterable[tuple[str, Any]]], *,
                 partitioned: bool, model_path: str, trust_remote_code: bool,
                 adapter: Callable[[str], str | None] | None = None):
        """`engine`: the rank's DeepSpeed engine; `torch`: the torch module (its RNG state is saved);
        `weights()`: walks the module's (name, tensor) pairs, gathering each module's parameters for the
        duration when `partitioned` (ZeRO-3: a collective, every rank must walk); `model_path` and
        `trust_remote_code`: where the export takes its tokenizer from, and how it loads it. `adapter`: a LoRA
        rank's writer of its adapters into a folder (lora.save_adapter; every rank calls it under ZeRO-3): its
        checkpoints hold the adapters and their optimizer state, not the frozen base weights (they are the
        model folder's, loaded again on resume), and its export has the adapter folder beside the merged
        policy."""
        self.engine, self.torch, self.rank, self.weights = engine, torch, rank, weights
        self.adapter = adapter
        self.adapters_only = adapter is not None
        self.partitioned = partitioned
        self.model_path, self.trust_remote_code = model_path, trust_remote_code

    def full_state_dict(self, everywhere: bool = False, as_numpy: bool = False) -> dict:
        """Full weights, each a CPU copy in the module's dtype (the training dtype: bf16 under train.dtype bf16),
        or with `as_numpy` an fp32 numpy array (numpy has no bf16). ZeRO-3: gathered module by module, and
        every rank must call it; ranks other than 0 get {} unless `everywhere`."""
        keep = everywhere or self.rank == 0 or not self.partitioned

        def copy(tensor):
            return tensor.float().cpu().numpy().copy() if as_numpy else tensor.detach().to("cpu", copy=True)

        return {name: copy(tensor) for name, tensor in self.weights() if keep}

    def save(self, folder: str, version: int) -> None:
        """Every rank: DeepSpeed engine state (model, optimizer, scheduler; its shard under ZeRO) with the
        policy `version` into folder/engine, and this rank's RNG states into folder/rng/rank_N.json."""
        folder = Path(folder)
        self.engine.save_checkpoint(
            str(folder), tag="engine", client_state={"policy_version": version}, save_latest=False,
            exclude_frozen_parameters=self.adapters_only,
        )
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        (folder / "rng" / f"rank_{self.rank}.json").write_text(json.dumps(rng_state(self.torch)))

    def load(self, folder: str, version: int) -> int:
        """Every rank: restore the engine and RNG states of the checkpoint of policy `version`; the
        restored version (a checkpoint whose engine state says another one is refused)."""
        folder = Path(folder)
        path, client_state = self.engine.load_checkpoint(
            str(folder), tag="engine", load_optimizer_states=True, load_lr_scheduler_states=True,
            # a LoRA checkpoint has no frozen weights: the module's are the model folder's, and stay (a resume
            # with another train.lora is refused before any actor starts: pipelines/recovery/resume.py)
            load_module_strict=not self.adapters_only,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed engine state in {folder / 'engine'}")
        restored = int(client_state.get("policy_version", version))
        if restored != version:
            raise ValueError(f"{folder}: engine state is policy version {restored}, the checkpoint says {version}")
        rng_file = folder / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            set_rng_state(self.torch, json.loads(rng_file.read_text()))
        return version

    def save_pretrained(self, path: str, tokenizer: bool = False) -> str | None:
        """Write an HF checkpoint in the training dtype (the module's: its config's dtype says the same), rank 0
        writes; every rank must call it under ZeRO-3. A LoRA rank's export is the merged policy, with peft's
        adapter folder in path/adapter (lora.save_adapter). With the model folder's tokenizer when `tokenizer` (so
        the folder loads with from_pretrained / vLLM)."""
        state = self.full_state_dict()  # every rank under ZeRO-3 (collective); {} except on rank 0
        if self.adapter is not None:  # LoRA: the adapters on their own too (a collective under ZeRO-3)
            self.adapter(path)
        if self.rank != 0:
            return None
        self.engine.module.save_pretrained(path, state_dict=state)
        if tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(
                self.model_path, local_files_only=True, trust_remote_code=self.trust_remote_code
            ).save_pretrained(path)
        return path


def rng_state(torch) -> dict:
    """The process's torch, numpy and Python RNG states, as JSON-able values."""
    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(torch, state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch_state = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(torch_state))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
