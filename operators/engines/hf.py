"""Hugging Face `generate` as a rollout engine: the fallback that runs anywhere torch does.

The behaviour log-probs, log_softmax(logits / T) of each sampled token (untruncated by top-p), are scored
after generation in one forward over prompt + response, the LM head running on at most
`logits_chunk_tokens` positions at a time (operators/algorithms/logprobs.py, as the trainer and the reference model
do): neither generate's per-step logits nor the [B*n, T, V] log-softmax are ever held."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from operators.common.devices import local_device, refuse_zero3_partitioned_build
from operators.engines.base import GroupSample, SamplingParams
from operators.algorithms.logprobs import next_token_logprobs
from operators.common.prompts import cut_at_stop, stop_token_ids
from operators.weights.buckets import as_weight_set


class HFEngine:
    def __init__(self, model_path: str, trust_remote_code: bool = False, torch_threads: int | None = None,
                 logits_chunk_tokens: int = 2048, adapters: dict | None = None):
        """`adapters`: versions arrive as LoRA adapters ({r, alpha, target_modules}; rollout.lora_adapters): peft's
        layers go around the base model here (B = 0: the base model until the first version loads)."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.tokenizer.padding_side = "left"  # generation continues from the right edge
        # The GPU Ray assigned to this actor (its only visible one), else the CPU (operators.common.devices).
        self.device = local_device(torch, role="the HF engine")
        refuse_zero3_partitioned_build("the HF engine")  # a ZeRO-3 rank in this process would shard it
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch.float32
        ).to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)  # the generation config's EOS ids too
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.logits_chunk_tokens = logits_chunk_tokens  # 0: the full logits at once
        self.adapted = adapters is not None
        if self.adapted:
            from peft import LoraConfig, inject_adapter_in_model

            config = LoraConfig(r=int(adapters["r"]), lora_alpha=float(adapters["alpha"]), bias="none",
                                target_modules=adapters.get("target_modules", "all-linear"))
            self.model = inject_adapter_in_model(config, self.model).eval()

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        padded = self.tokenizer.pad({"input_ids": prompt_token_ids}, padding=True, return_tensors="pt")
        torch.manual_seed(params.seed)  # HF generate samples from the global generator
        greedy = params.temperature == 0  # vLLM's convention: temperature 0 decodes greedily
        sampling = {} if greedy else dict(temperature=params.temperature, top_p=params.top_p, top_k=0)
        out = self.model.generate(
            input_ids=padded["input_ids"].to(self.device),
            attention_mask=padded["attention_mask"].to(self.device),
            do_sample=not greedy,
            **sampling,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,
            num_return_sequences=params.n,
            eos_token_id=list(self.stop_ids) or None,
            pad_token_id=self.pad_id,
        )
        logprobs = self._logprobs(out, padded["attention_mask"].to(self.device), params).cpu()  # [B*n, T]
        new_tokens = out[:, padded["input_ids"].shape[1]:].cpu()  # [B*n, T]
        groups = []
        for prompt_index in range(len(prompt_token_ids)):
            group = GroupSample()
            for row in range(prompt_index * params.n, (prompt_index + 1) * params.n):
                tokens = new_tokens[row].tolist()
                length = len(cut_at_stop(tokens, self.stop_ids))  # keep the stop token
                group.token_ids.append(tokens[:length])
                group.logprobs.append(logprobs[row, :length].tolist())
                group.texts.append(self.tokenizer.decode(tokens[:length], skip_special_tokens=True))
            groups.append(group)
        return groups

    def _logprobs(self, sequences: torch.Tensor, prompt_attention: torch.Tensor, params: SamplingParams):
        """log_softmax(logits / T) [B*n, T] of the generated tokens of `sequences` [B*n, P+T] (left-padded
        prompts [B, P], each repeated n times, then the generated tokens), at the positions generate used."""
        width = prompt_attention.shape[1]
        attention = torch.cat([prompt_attention.repeat_interleave(params.n, dim=0),
                               torch.ones_like(sequences[:, width:])], dim=1)  # [B*n, P+T]
        positions = (attention.cumsum(-1) - 1).clamp_min(0)  # [B*n, P+T], as generate numbers a left-padded row
        return next_token_logprobs(self.model, sequences, attention, params.temperature or 1.0,
                                   self.logits_chunk_tokens, position_ids=positions, start=width - 1)

    def score(self, token_ids: list[int], request_id: str = "") -> list[float]:
        """log_softmax(logits) of each token after the first (the served-policy probe, operators/weights/probe.py)."""
        ids = torch.tensor([token_ids], device=self.device)
        return [float(x) for x in next_token_logprobs(self.model, ids, torch.ones_like(ids), 1.0, 0)[0].cpu()]

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        # views of the buckets (read-only object-store buffers): load_state_dict copies and casts them
        state = as_weight_set(state_dict).state_dict()
        if not self.adapted:
            self.model.load_state_dict(state, strict=True)
            return
        from operators.weights.lora_merge import module_adapter_name

        mapped = {module_adapter_name(name): tensor for name, tensor in state.items()}
        expected = {name for name in self.model.state_dict() if ".lora_" in name}
        if set(mapped) != expected:
            raise ValueError(f"the adapter's tensors are not this engine's adapters: {sorted(set(mapped) ^ expected)[:4]}")
        self.model.load_state_dict(mapped, strict=False)
