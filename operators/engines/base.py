"""The interface every generation engine implements, so `Generate` does not care which runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 decodes greedily (log-probs are then of the untempered distribution)."""

    n: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GroupSample:
    """The `n` responses of one prompt. Log-probs are of the sampled tokens under the
    sampling distribution (temperature applied), one per response token."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[GroupSample]:
        """One GroupSample per prompt, each with `params.n` responses."""

    def load_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
        """Replace the policy weights in place (names as in the HF state dict)."""

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Prompt token ids (with BOS where the tokenizer adds it)."""


def make_engine(name: str, model_path: str, **options) -> RolloutEngine:
    if name == "hf":
        from operators.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    elif name == "vllm":
        from operators.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, **options)
    elif name == "sim":  # a cost model, not a model: `model_path` is its JSON file (benchmarks/simulate_cluster.py)
        from operators.engines.sim import SimEngine

        return SimEngine(model_path, **options)
    raise ValueError(f"unknown rollout engine {name!r}; use 'hf', 'vllm' or 'sim'")
