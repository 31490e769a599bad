"""Hugging Face `generate` as a rollout engine: the fallback that runs anywhere torch does."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from operators.devices import local_device
from operators.engines.base import GroupSample, SamplingParams
from operators.prompts import cut_at_stop, stop_token_ids
from operators.weights import as_weight_set


class HFEngine:
    def __init__(self, model_path: str, trust_remote_code: bool = False, torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        self.tokenizer.padding_side = "left"  # generation continues from the right edge
        # The GPU Ray assigned to this actor (its only visible one), else the CPU (operators.devices).
        self.device = local_device(torch, role="the HF engine")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code, dtype=torch.float32
        ).to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)  # the generation config's EOS ids too
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

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
            return_dict_in_generate=True,
            output_logits=True,
        )
        new_tokens = out.sequences[:, padded["input_ids"].shape[1]:]  # [B*n, T]
        logits = torch.stack(out.logits, dim=1).float() / (params.temperature or 1.0)  # [B*n, T, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1).cpu()  # [B*n, T]
        new_tokens = new_tokens.cpu()
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

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        # views of the buckets (read-only object-store buffers): load_state_dict copies and casts them
        self.model.load_state_dict(as_weight_set(state_dict).state_dict(), strict=True)
