"""What a trainer rank is told: its settings and its learning-rate schedule. Shared by the policy ranks
(operators/workers/train_worker.py) and the critic ranks (operators/workers/value_worker.py).

TrainerSettings is the one declaration of what a rank reads: pipelines/runtime/trainer_settings.py fills each
field from the config field of the same name (train, algorithm, rollout, model; the critic's from its own
section first), so a field added here and to its config section needs no mapping of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from operators.algorithms.correction import CorrectionSettings
from operators.workers.lora import LoraSettings


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate over optimizer steps, as a factor of the peak lr: a linear warm-up over
    `warmup_steps` (lr/warmup_steps, 2 lr/warmup_steps, ... lr), then constant, or a cosine that
    reaches `min_ratio` x lr at optimizer step `total_steps` (the job's last)."""

    warmup_steps: int = 0
    total_steps: int = 0
    kind: str = "constant"
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        """The factor of optimizer step `step` (0 for the first)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps - 1, 1)
            progress = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
            return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


@dataclass(frozen=True)
class TrainerSettings:
    """A rank's settings, each named as its config field (pipelines/runtime/trainer_settings.py fills them by
    name); the defaults here equal the config's (tests/unit/test_config.py checks), for loops that build a rank
    by hand."""

    model_path: str
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 0
    dtype: str = "fp32"
    seed: int = 0
    torch_threads: int = 1
    temperature: float = 1.0
    policy_loss: str = "ppo_clip"
    loss_aggregation: str = "token_mean"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    max_new_tokens: int = 4
    trust_remote_code: bool = False
    micro_batch_tokens: int = 0
    packing: bool = True  # micro-batches packed into rows with restarting positions, little padding (operators/algorithms/batching.py)
    share_prompts: bool = False  # a group's prompt laid out once before its responses (operators/algorithms/shared_prompts.py)
    logits_chunk_tokens: int = 2048  # log-probs of at most this many positions at once (0: all at once)
    gradient_checkpointing: bool = False
    weight_bucket_mb: float = 256  # the weight channel's bucket size (operators/weights/buckets.py)
    weight_transfer: str = "object_store"  # "gloo": the weight plane (operators/weights/gloo_plane.py); rank 0 sends
    weight_timeout_s: float = 300.0  # the weight plane's longest wait
    verify_weights_every: int = 50  # the weight plane: checksums on the first update and every n-th
    probe_every: int = 1  # the served-policy probe (operators/weights/probe.py) on every n-th version (0: never)
    probe_tolerance: float = 1e-3  # the probe's largest mean gap per token (trainer_settings resolves the default)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    zero3_persistence_threshold: int | None = None  # DeepSpeed's default (1e5 elements) when None
    nan_policy: str = "skip"  # a non-finite loss: "skip" the step (weights unchanged) or "stop" the job
    clip_ratio_c: float = 3.0  # decoupled_ppo's dual-clip bound for negative advantages
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)  # TIS / MIS on pi_prox / pi_behave
    kl_coef: float = 0.0  # weight of the KL-to-reference term (needs per-sample ref_logprobs)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    ppo_epochs: int = 1  # passes over the step's samples
    mini_batches: int = 1  # optimizer steps per pass; each gets 1/mini_batches of the rank's samples
    serve_adapters: bool = False  # rollout.lora_adapters: the publisher sends the adapters alone, not merged weights
    reference_on_trainer: bool = False  # train.lora: ref_logprobs from this model with its adapters off
    lora: LoraSettings | None = None  # train.lora: adapters only train (operators/workers/lora.py); None: every weight
