"""Policy losses, loss aggregation modes and token-level helpers (torch).

Shapes: B sequences, T response-token positions, V vocabulary size.
`mask` is [B, T] (bool or 0/1 float) marking valid response tokens; padded
positions are excluded from every loss and statistic here.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .registry import Registry

POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is set; scalar tensor.

    An all-zero mask gives 0 instead of NaN, so an empty micro-batch adds
    nothing rather than poisoning the gradients.
    """
    mask = mask.to(x.dtype)  # [B, T]
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy -sum_v p log p of softmax(logits); [B, T, V] -> [B, T].

    Uses log_softmax for stability. Logits of -inf (masked vocabulary) give
    p = 0 and log p = -inf; clamping log p to the dtype's minimum makes that
    term 0 * finite = 0 instead of NaN.
    """
    logp = F.log_softmax(logits, dim=-1)  # [B, T, V]
    logp_finite = logp.clamp_min(torch.finfo(logp.dtype).min)  # [B, T, V]
    return -(logp.exp() * logp_finite).sum(dim=-1)  # [B, T]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token; logits [B, T, V], tokens [B, T] -> [B, T]."""
    logp = F.log_softmax(logits, dim=-1)  # [B, T, V]
    return logp.gather(dim=-1, index=tokens.long().unsqueeze(-1)).squeeze(-1)  # [B, T]


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017), with asymmetric clip range (DAPO "clip-higher").

        ratio = exp(logprobs - old_logprobs)
        loss  = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high))

    Inputs are all [B, T]; `advantages` already broadcast over tokens.
    Returns the per-token loss [B, T] (unmasked: reduce it with a
    LOSS_AGGREGATIONS entry, which applies the mask) and detached float stats
    over masked tokens:
      clip_fraction: fraction of tokens where the clipped term is strictly the
                     larger one, i.e. where clipping changed the loss;
      approx_kl:     k3 estimator of KL(old || new) (Schulman, "Approximating
                     KL divergence"): mean of (ratio - 1) - log(ratio), which is
                     unbiased and >= 0 since tokens were sampled from the old policy;
      ratio_mean, ratio_max.
    """
    log_ratio = logprobs - old_logprobs  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, T]
    per_token_loss = torch.maximum(unclipped, clipped)  # [B, T]
    stats = _ppo_stats(log_ratio.detach(), (clipped > unclipped).detach(), mask)
    return per_token_loss, stats


def _ppo_stats(log_ratio: torch.Tensor, clip_active: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """Masked-token statistics for ppo_clip; all inputs [B, T]."""
    valid = mask.bool()  # [B, T]
    if not valid.any():
        # Nothing to measure; report the values of an unchanged policy.
        return {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0}
    # float64: these are a few detached scalars, and exact counts beat bf16/fp32 rounding.
    log_ratio = log_ratio[valid].double()  # [N] valid tokens
    ratio = torch.exp(log_ratio)  # [N]
    return {
        "clip_fraction": clip_active[valid].double().mean().item(),
        "approx_kl": ((ratio - 1.0) - log_ratio).mean().item(),
        "ratio_mean": ratio.mean().item(),
        "ratio_max": ratio.max().item(),
    }


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, *, num_tokens: Optional[float] = None
) -> torch.Tensor:
    """Token-level mean (DAPO): sum(loss * mask) / sum(mask). The default.

    Every token weighs the same, so long responses are not diluted. Pass
    `num_tokens` (e.g. the global valid-token count across data-parallel
    ranks) to replace sum(mask) as the denominator, so per-rank losses sum to
    the global token mean.
    """
    if num_tokens is None:
        return masked_mean(per_token_loss, mask)
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return (per_token_loss * mask.to(per_token_loss.dtype)).sum() / num_tokens


@LOSS_AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence-level mean of per-sequence token means (original GRPO).

        (1/B') * sum_b [ sum_t loss[b,t] m[b,t] / sum_t m[b,t] ]

    over the B' sequences with at least one valid token; sequences without
    tokens are excluded rather than counted as zero loss.
    """
    mask = mask.to(per_token_loss.dtype)  # [B, T]
    seq_len = mask.sum(dim=-1)  # [B]
    # Empty sequences have a zero numerator, so clamping their length to 1 makes them contribute 0.
    seq_loss = (per_token_loss * mask).sum(dim=-1) / seq_len.clamp_min(1.0)  # [B]
    num_seqs = (seq_len > 0).sum().clamp_min(1)
    return seq_loss.sum() / num_seqs


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_tokens: int,
    num_sequences: Optional[int] = None,
) -> torch.Tensor:
    """Dr. GRPO aggregation (Liu et al. 2025): sum(loss * mask) / (B * max_tokens).

    Dividing by the constant generation budget `max_tokens` instead of each
    response's length removes GRPO's length bias. `num_sequences` replaces B
    (e.g. the global sequence count across data-parallel ranks).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    num_seqs = per_token_loss.shape[0] if num_sequences is None else num_sequences
    if num_seqs <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_seqs}")
    return (per_token_loss * mask.to(per_token_loss.dtype)).sum() / (num_seqs * max_tokens)
