"""The served-policy probe: proof, after a weight update, that an engine samples from the policy the trainer
trained, not from the weights it had before.

Checksums (operators/weights/checksums.py) prove the bytes that arrived and the tensors vLLM keeps as sent,
but not the linear layers, which vLLM fuses and repacks on CPU: an engine that never applied an update to
them (the failure of verl #7495 and ms-swift #9855, async LoRA runs that silently sampled the base model)
would pass them. The probe checks behaviour instead. For each version it is due on, the trainer scores a
fixed token sequence under the weights it publishes, before it publishes them, and puts the log-probs in the
policy store (operators/weights/store.py); each engine, once it has applied that version, scores the same
sequence and compares (`check_served`). A gap beyond the tolerance ends the attempt with a message naming
the version and the engine (`ServedPolicyMismatch`).

The sequence is arithmetic text every tokenizer here encodes (the tiny model's has only digits and
+-*= and space); each token's log-prob depends on every layer's weights. The log-probs are those of the
untempered distribution, log_softmax(logits), as vLLM reports prompt log-probs.

The gap is the mean absolute difference of the per-token log-probs. Defaults (rollout.probe_tolerance): 1e-3
when trainer and engine both compute in float32 (measured: 1.4e-6 on every update of the tiny model with LoRA
on vLLM, 9e-6 with SmolLM2-135M on vLLM, and 0.475 when the tiny model's engine skipped its first update), 0.05 otherwise (16-bit rounding; not measured:
no GPU here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from operators.weights.plane import WeightMismatch

# Short enough for any engine context (the tiny model has 64 positions, one token per character).
PROBE_TEXT = "12+7=19 3*4=12 25-8=17 6+9=15"
PROBE_TOKENS = 32  # at most this many tokens of it
FP32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 0.05


class ServedPolicyMismatch(WeightMismatch):
    """An engine's log-probs for the probe differ from the trainer's for the version it says it serves."""


@dataclass(frozen=True)
class ProbeRecord:
    """What the trainer measured for one version: the probe's token ids, the log-prob of each token after the
    first under that version's weights, and the largest mean gap an engine may show."""

    version: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float


def probe_tolerance(configured: float | None, train_dtype: str, engine_dtype: str) -> float:
    """The configured tolerance, or the default for the two sides' dtypes (see the module docstring)."""
    if configured is not None:
        return float(configured)
    # vLLM's "auto" takes the model config's dtype, bf16 for most models today: not known to be fp32
    both_fp32 = train_dtype == "fp32" and engine_dtype == "float32"
    return FP32_TOLERANCE if both_fp32 else LOW_PRECISION_TOLERANCE


def probe_gap(engine_logprobs, trainer_logprobs) -> float:
    """Mean absolute difference per token; inf when the lengths differ (a different sequence was scored)."""
    if len(engine_logprobs) != len(trainer_logprobs) or not trainer_logprobs:
        return float("inf")
    return sum(abs(float(a) - float(b)) for a, b in zip(engine_logprobs, trainer_logprobs)) / len(trainer_logprobs)


def check_served(record: ProbeRecord, engine_logprobs, engine: str) -> float:
    """The gap of `engine`'s probe log-probs from the trainer's; raises ServedPolicyMismatch beyond the tolerance."""
    gap = probe_gap(engine_logprobs, record.logprobs)
    if gap > record.tolerance:
        raise ServedPolicyMismatch(
            f"engine {engine} does not serve the trained policy version {record.version}: its log-probs of the "
            f"probe differ from the trainer's by {gap:.3g} per token on average (tolerance {record.tolerance:g}, "
            "rollout.probe_tolerance). It samples from weights nobody trained (for instance an update it never "
            "applied), so the attempt stops before training on them; if it repeats, report it with this message")
    return gap


class ServedProbe:
    """The trainer's side, on every rank that joins a publish: `measure(version)` scores the probe when it is
    due (a forward pass; under ZeRO-3 a collective, so every rank calls it in the same order) and returns the
    record, None when not due."""

    def __init__(self, token_ids: list[int], every: int, tolerance: float,
                 logprobs: Callable[[list[int]], list[float]]):
        self.token_ids, self.every, self.tolerance, self._logprobs = tuple(token_ids), int(every), tolerance, logprobs

    def due(self, version: int) -> bool:
        return self.every > 0 and version > 0 and version % self.every == 0

    def measure(self, version: int) -> ProbeRecord | None:
        if not self.due(version):
            return None
        return ProbeRecord(version, self.token_ids, tuple(self._logprobs(list(self.token_ids))), self.tolerance)


def module_scorer(torch, module, device) -> Callable[[list[int]], list[float]]:
    """Log-probs of a token sequence under `module` (a Hugging Face causal LM; a DeepSpeed engine's module,
    peft's adapters active), in eval mode (no dropout) for the call, untempered."""
    from operators.algorithms.logprobs import next_token_logprobs

    def score(token_ids: list[int]) -> list[float]:
        was_training = module.training
        module.eval()
        try:
            ids = torch.tensor([token_ids], device=device)
            logprobs = next_token_logprobs(module, ids, torch.ones_like(ids), 1.0, 0)
        finally:
            module.train(was_training)
        return [float(x) for x in logprobs[0].float().cpu()]

    return score


def served_probe(torch, module, device, settings) -> ServedProbe | None:
    """A policy rank's probe from its TrainerSettings (None when rollout.probe_every is 0): PROBE_TEXT in the
    model folder's tokenizer."""
    if not settings.probe_every:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_path, local_files_only=True,
                                              trust_remote_code=settings.trust_remote_code)
    token_ids = tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"][:PROBE_TOKENS]
    return ServedProbe(token_ids, settings.probe_every, settings.probe_tolerance, module_scorer(torch, module, device))
