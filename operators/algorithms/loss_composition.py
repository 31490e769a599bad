"""The policy's loss of one micro-batch, composed from the registered pieces (operators/algorithms/losses.py,
correction.py): the policy loss against the behaviour log-probs, the mismatch correction, the entropy bonus and
the KL-to-reference term; its aggregation into a scalar that adds up over micro-batches and averages over
ranks to the global aggregate; and the token-weighted statistics the ranks report.

Pure maths on tensors: the trainer rank (operators/workers/train_worker.py) runs the forward and the backward.
"""

from __future__ import annotations

import inspect

from operators.algorithms.correction import behavior_log_ratio, correction_factors
from operators.algorithms.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, bounded_exp, kl_k3


class StatSums:
    """Token-weighted means of per-batch statistics; *_max keep the maximum, *_min the minimum."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.tokens: dict[str, float] = {}

    def add(self, stats: dict, tokens: float) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, float("-inf")), float(value))
            elif key.endswith("_min"):
                self.sums[key] = min(self.sums.get(key, float("inf")), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * tokens
                self.tokens[key] = self.tokens.get(key, 0.0) + tokens

    def means(self) -> dict:
        return {key: value if key not in self.tokens else value / max(self.tokens[key], 1.0)
                for key, value in self.sums.items()}


def ratio_range(log_ratio, mask) -> tuple[float, float]:
    """(min, max) of exp(log_ratio) over valid tokens; [B, T] inputs; (1, 1) when there are none."""
    values = bounded_exp(log_ratio[mask.bool()].double())  # [N]
    return (values.min().item(), values.max().item()) if values.numel() else (1.0, 1.0)


def policy_token_loss(settings, logprobs, entropy, behavior, advantages, mask, proximal, ref_logprobs=None):
    """The policy's per-token loss [B, L-1] of one micro-batch, its statistics, and the behaviour
    mismatch (log_rho, truncated, masked) for `mismatch_sums`.

    `settings`: the rank's TrainerSettings (operators/workers/settings.py; read here: policy_loss,
    clip_eps_low, clip_eps_high, clip_ratio_c, correction, entropy_coef, kl_estimator, kl_coef).
    `logprobs` and `entropy` [B, L-1]: the trainer's, with a graph; `behavior`, `advantages`, `mask`,
    `proximal` (pi_prox) and `ref_logprobs` (None: no KL term) [B, L-1] each."""
    loss_fn = POLICY_LOSSES.get(settings.policy_loss)
    accepted = inspect.signature(loss_fn).parameters
    options = {"proximal_logprobs": proximal, "clip_eps_low": settings.clip_eps_low,
               "clip_eps_high": settings.clip_eps_high, "clip_ratio_c": settings.clip_ratio_c}
    per_token_loss, loss_stats = loss_fn(logprobs, behavior, advantages, mask,
                                         **{k: v for k, v in options.items() if k in accepted})
    log_rho = behavior_log_ratio(proximal, behavior, mask)  # [B, L-1]
    factor, truncated, masked = correction_factors(log_rho, mask, settings.correction)  # [B, L-1] each
    per_token_loss = per_token_loss * factor - settings.entropy_coef * entropy  # [B, L-1]
    if ref_logprobs is not None:
        tokens = float(mask.sum().item())
        kl = KL_ESTIMATORS.get(settings.kl_estimator)(logprobs, ref_logprobs)  # [B, L-1]
        per_token_loss = per_token_loss + settings.kl_coef * kl
        loss_stats["kl_ref"] = float((kl_k3(logprobs.detach(), ref_logprobs) * mask).sum()) / max(tokens, 1)
    return per_token_loss, loss_stats, (log_rho, truncated, masked)


def add_policy_stats(loss_stats: dict, logprobs, entropy, behavior, mask) -> None:
    """Add the micro-batch's mean entropy and the range of pi_theta / pi_behave (whatever the loss's own
    ratio is centred on) to `loss_stats`; [B, L-1] inputs."""
    tokens = float(mask.sum().item())
    loss_stats["entropy"] = float((entropy.detach() * mask).sum()) / max(tokens, 1)
    loss_stats["ratio_behavior_min"], loss_stats["ratio_behavior_max"] = ratio_range(logprobs.detach() - behavior, mask)


def rank_aggregate(aggregation: str, per_token_loss, mask, global_tokens: float, global_sequences: float,
                   world_size: int, max_tokens: int, share: float = 1.0):
    """Aggregate so that the DeepSpeed gradient average over ranks equals the global aggregate.

    Aggregations normalised by a global count (tokens, sequences) are sums over samples,
    so micro-batch losses add up exactly; one that averages over its own batch
    (seq_mean_token_mean) is weighted by `share`: the micro-batch's responses over the mini-batch's
    on all ranks, times the world size (DeepSpeed divides by it)."""
    aggregate = LOSS_AGGREGATIONS.get(aggregation)
    options = {
        "num_tokens": global_tokens / world_size,
        "num_sequences": global_sequences / world_size,
        "max_tokens": max_tokens,
    }
    accepted = inspect.signature(aggregate).parameters
    loss = aggregate(per_token_loss, mask, **{k: v for k, v in options.items() if k in accepted})
    linear = any(k in accepted for k in ("num_tokens", "num_sequences"))
    return loss if linear else loss * share
