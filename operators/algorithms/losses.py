"""Policy and value losses, KL estimators, loss aggregation modes and token-level helpers (torch).

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
KL_ESTIMATORS = Registry("KL estimator")
VALUE_LOSSES = Registry("value loss")


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


def chunked_token_logprobs(
    hidden: torch.Tensor, head, tokens: torch.Tensor, temperature: float, chunk_positions: int,
    entropy_grad: bool = False, with_entropy: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the chosen tokens and the entropy at each position, from the final hidden states,
    `chunk_positions` positions at a time; hidden [B, T, H], tokens [B, T] -> ([B, T], [B, T]) fp32.

    `head` maps hidden states to logits (the LM head). Only one chunk's [B, C, V] fp32 logits exist
    at a time: under autograd each chunk is checkpointed (its logits are recomputed in backward from
    the chunk's hidden states instead of being kept), so the memory of a long sequence over a large
    vocabulary is B x C x V, not B x T x V. The entropy carries a gradient only when `entropy_grad`
    (an entropy bonus in the loss); otherwise it is a metric, computed without a graph. Without
    `with_entropy` it is not computed (None): scoring alone skips its [B, C, V] temporaries."""

    def chunk(h: torch.Tensor, t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        logits = head(h).float() / temperature  # [B, C, V]
        logprobs = token_logprobs(logits, t)  # [B, C]
        if not with_entropy:
            return logprobs, None
        if entropy_grad:
            return logprobs, entropy_from_logits(logits)
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits.detach())  # [B, C]

    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled()
    parts = []
    for start in range(0, hidden.shape[1], max(1, chunk_positions)):
        h, t = hidden[:, start:start + chunk_positions], tokens[:, start:start + chunk_positions]
        parts.append(checkpoint(chunk, h, t, use_reentrant=False) if recompute else chunk(h, t))
    logprobs, entropy = zip(*parts)
    return torch.cat(logprobs, dim=1), torch.cat(entropy, dim=1) if with_entropy else None  # [B, T] each


# A log-ratio beyond this is clamped before exp: e^20 ~ 5e8 is far past any clip or cap, and an
# unbounded exp overflows to inf (then NaN gradients) on a token the engine gave ~0 probability.
LOG_RATIO_BOUND = 20.0


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-LOG_RATIO_BOUND: finite for any finite or infinite input."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


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

    The trainer passes the behaviour (engine) log-probs as `old_logprobs`: the trust region is
    centred on the policy that sampled the data, however stale ("naive" PPO under staleness).
    Inputs are all [B, T]; `advantages` already broadcast over tokens.
    Returns the per-token loss [B, T] (unmasked: reduce it with a
    LOSS_AGGREGATIONS entry, which applies the mask) and detached float stats
    over masked tokens:
      clip_fraction: fraction of tokens where the clipped term is strictly the
                     larger one, i.e. where clipping changed the loss;
      approx_kl:     k3 estimator of KL(old || new) (Schulman, "Approximating
                     KL divergence"): mean of (ratio - 1) - log(ratio), which is
                     unbiased and >= 0 since tokens were sampled from the old policy;
      ratio_mean, ratio_max, ratio_min.
    """
    log_ratio = logprobs - old_logprobs  # [B, T]
    ratio = bounded_exp(log_ratio)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, T]
    per_token_loss = torch.maximum(unclipped, clipped)  # [B, T]
    stats = _ppo_stats(log_ratio.detach(), (clipped > unclipped).detach(), mask)
    return per_token_loss, stats


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL).

    The trust region is centred on the proximal policy pi_prox (the weights at the start of the
    step's updates), and the behaviour policy that sampled the tokens is corrected for by an
    importance weight, so a stale sample is neither clipped against a policy k updates old nor
    silently ignored:

        w     = pi_prox / pi_behave = exp(proximal_logprobs - old_logprobs)   (detached)
        ratio = pi_theta / pi_prox  = exp(logprobs - proximal_logprobs)
        surr  = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high))
        surr  = min(surr, -A * clip_ratio_c)  where A < 0   (dual-clip, Ye et al. 2020; verl, DAPO)
        loss  = w * surr

    Dual-clip bounds the loss of a negative-advantage token whose ratio has grown past
    clip_ratio_c (> 1): the unclipped term -A * ratio would otherwise grow without bound.
    `old_logprobs` are the behaviour log-probs; `proximal_logprobs` are detached. All inputs [B, T].
    Stats as ppo_clip's, with ratio = pi_theta / pi_prox, plus dual_clip_fraction (tokens where
    the dual clip set the loss).
    """
    weight = bounded_exp(proximal_logprobs - old_logprobs).detach()  # [B, T]
    log_ratio = logprobs - proximal_logprobs  # [B, T]
    ratio = bounded_exp(log_ratio)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B, T]
    surrogate = torch.maximum(unclipped, clipped)  # [B, T]
    dual_bound = -advantages * clip_ratio_c  # [B, T]
    dual_active = (advantages < 0) & (surrogate > dual_bound)  # [B, T]
    surrogate = torch.where(dual_active, dual_bound, surrogate)  # [B, T]
    stats = _ppo_stats(log_ratio.detach(), (clipped > unclipped).detach(), mask)
    valid = mask.bool()  # [B, T]
    stats["dual_clip_fraction"] = dual_active[valid].double().mean().item() if valid.any() else 0.0
    return weight * surrogate, stats


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio.

        s_i    = exp( sum_t m_it (logprobs_it - old_logprobs_it) / sum_t m_it )   (length-normalised
                  geometric mean of the token ratios pi_theta / pi_behave over the response)
        A_i    = sum_t m_it A_it / sum_t m_it    (the response's advantage)
        loss_i = max(-A_i * s_i, -A_i * clamp(s_i, 1 - clip_eps_low, 1 + clip_eps_high))

    The per-sequence loss is broadcast over the sequence's tokens ([B, T] out), so
    seq_mean_token_mean aggregation gives the paper's 1/G * sum_i loss_i. As in the paper the
    old policy is the behaviour policy; its clip ranges are ~1e-4 (sequence ratios concentrate
    near 1), hence the defaults, but the trainer passes algorithm.clip_eps_low/high.
    Stats (token-weighted, each token counting its sequence's value): clip_fraction, approx_kl
    (k3 of the sequence ratio), ratio_mean, ratio_max, ratio_min of s_i.
    """
    weights = mask.to(logprobs.dtype)  # [B, T]
    lengths = weights.sum(dim=-1).clamp_min(1.0)  # [B]
    seq_log_ratio = ((logprobs - old_logprobs) * weights).sum(dim=-1) / lengths  # [B]
    seq_ratio = bounded_exp(seq_log_ratio)  # [B]
    seq_advantage = (advantages * weights).sum(dim=-1) / lengths  # [B]
    unclipped = -seq_advantage * seq_ratio  # [B]
    clipped = -seq_advantage * torch.clamp(seq_ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [B]
    seq_loss = torch.maximum(unclipped, clipped)  # [B]
    per_token_loss = seq_loss.unsqueeze(-1).expand_as(logprobs)  # [B, T]
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1).expand_as(logprobs)  # [B, T]
    token_clipped = (clipped > unclipped).detach().unsqueeze(-1).expand_as(logprobs)  # [B, T]
    return per_token_loss, _ppo_stats(token_log_ratio, token_clipped, mask)


def _ppo_stats(log_ratio: torch.Tensor, clip_active: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """Masked-token statistics of a PPO-style ratio; all inputs [B, T]."""
    valid = mask.bool()  # [B, T]
    if not valid.any():
        # Nothing to measure; report the values of an unchanged policy.
        return {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "ratio_min": 1.0}
    # float64: these are a few detached scalars, and exact counts beat bf16/fp32 rounding.
    log_ratio = log_ratio[valid].double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [N] valid tokens
    ratio = torch.exp(log_ratio)  # [N]
    return {
        "clip_fraction": clip_active[valid].double().mean().item(),
        "approx_kl": ((ratio - 1.0) - log_ratio).mean().item(),
        "ratio_mean": ratio.mean().item(),
        "ratio_max": ratio.max().item(),
        "ratio_min": ratio.min().item(),
    }


# ----------------------------------------------------------------- KL to a reference


@VALUE_LOSSES.register("clipped")
def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, value_clip: float
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO's clipped value loss (per token); all inputs [B, T] -> ([B, T], stats).

        L_t = 1/2 max((V_t - R_t)^2, (clip(V_t, V_old_t - eps, V_old_t + eps) - R_t)^2)

    The 1/2 is verl's and OpenRLHF's (its gradient is V_t - R_t). V_old are the values of the critic
    at the start of the step's updates (ValueWorker: the Value stage's values when the critic that made
    them is still current, else its own forward before the first update), so one step cannot move a
    value further than eps from the current critic's in the direction that lowers the loss. stats:
    `value_clip_fraction`, the share of valid tokens whose clipped term is the larger (their gradient is
    zero).
    """
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)  # [B, T]
    unclipped_loss = (values - returns) ** 2  # [B, T]
    clipped_loss = (clipped - returns) ** 2  # [B, T]
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss) * mask  # [B, T]
    clip_active = (clipped_loss > unclipped_loss).to(values.dtype)  # [B, T]
    return per_token, {"value_clip_fraction": float(masked_mean(clip_active.detach(), mask))}


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref per token, [B, T] -> [B, T] (Schulman, "Approximating KL").

    Unbiased for KL(pi_theta || pi_ref) on tokens sampled from pi_theta, but negative on some
    tokens and high-variance."""
    return logprobs - ref_logprobs  # [B, T]


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_theta - log pi_ref)^2 / 2 per token, [B, T] -> [B, T]: >= 0, low variance,
    biased (second-order accurate when the policies are close); its gradient is that of the KL."""
    return 0.5 * (logprobs - ref_logprobs) ** 2  # [B, T]


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r with r = pi_ref / pi_theta per token, [B, T] -> [B, T]: unbiased for
    KL(pi_theta || pi_ref), >= 0 and low-variance (the "low-variance KL" of GRPO/verl). The log
    ratio is clamped (LOG_RATIO_BOUND) so r stays finite."""
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    return torch.exp(log_r) - 1.0 - log_r  # [B, T]


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
