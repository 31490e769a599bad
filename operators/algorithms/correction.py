"""Rollout-training mismatch correction: truncated importance sampling (TIS) and masking (MIS).

Everything here works on the behaviour ratio

    rho = pi_prox / pi_behave = exp(proximal_logprobs - behavior_logprobs)      [B, T]

where pi_behave is the engine's sampling distribution (its log-probs travel with each sample)
and pi_prox is the trainer's policy at the start of the step's updates (AReaL's "proximal"
policy, verl rollout correction's "old" policy recomputed by the trainer). rho mixes the two
things that make a sample off-policy: staleness (the weights moved since the engine sampled)
and mismatch (engine and trainer compute different log-probs for the same weights: bf16 vs
fp32, kernels). It is detached: corrections reweight the gradient, they never carry one.

The token-level policy losses carry rho_t on each token: decoupled_ppo as its explicit weight,
ppo_clip inside its ratio pi_theta / pi_behave = (pi_theta / pi_prox) * rho_t. So the corrections
are factors on their per-token loss. gspo's sequence ratio carries the geometric mean of rho over
the response instead, so TIS (which replaces rho_t) does not apply to it and the config refuses the
pair; MIS, a 0/1 mask, applies to any loss:

  TIS   the effective behaviour weight w becomes min(w, cap): "token" w = rho_t, per token (factor
        min(1, cap / rho_t)); "sequence" w = prod_t rho_t, the whole response's ratio, on each of its
        tokens (factor min(prod rho, cap) / rho_t: the loss already carries rho_t, which the sequence
        weight replaces, as in verl's sequence-level rollout correction);
  MIS   factor = 1 where rho is inside [low, high], else 0 (the token or the response is
        dropped from the gradient; it still counts in the loss's normaliser, as a zero):
        "token" per token, "sequence" on prod_t rho_t, "geometric" on the geometric mean
        exp(mean_t log rho_t), which does not grow with the response length.

Log-ratios are clamped to +-LOG_RATIO_BOUND before any exp (a token the engine gave ~0
probability would otherwise give rho = inf, then NaN gradients: prime-rl #2972).

The mismatch statistics (`mismatch_sums` on each rank, `merge_mismatch` over ranks and
micro-batches) report rho's mean / max / min / p50 / p90 / p99, the fractions truncated and
masked, and KL(pi_behave || pi_prox) by the k1 and k3 estimators, overall and per staleness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .losses import LOG_RATIO_BOUND
from .registry import Registry

TIS_MODES = Registry("truncated importance sampling mode")
MIS_MODES = Registry("importance masking mode")

# Quantile levels each rank summarises rho by; merged quantiles are approximate (see merge_mismatch).
SKETCH_LEVELS = np.linspace(0.0, 1.0, 101)


@dataclass(frozen=True)
class CorrectionSettings:
    tis: str = "none"  # "none" or a TIS_MODES name
    tis_cap: float = 2.0
    mis: str = "none"  # "none" or a MIS_MODES name
    mis_low: float = 0.5
    mis_high: float = 2.0


def behavior_log_ratio(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """log rho = log pi_prox - log pi_behave, clamped, detached, 0 on padding; [B, T] -> [B, T]."""
    log_rho = (proximal_logprobs - behavior_logprobs).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, T]
    return torch.where(mask.bool(), log_rho, torch.zeros_like(log_rho))  # [B, T]


def _sequence_log_ratio(log_rho: torch.Tensor) -> torch.Tensor:
    """log prod_t rho_t per response, broadcast back over its tokens; [B, T] -> [B, T] (padding is 0)."""
    return log_rho.sum(dim=-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(log_rho)  # [B, T]


@TIS_MODES.register("token")
def tis_token(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token behaviour weight to cap: log rho_t; log_rho, mask [B, T] -> [B, T]."""
    return log_rho  # [B, T]


@TIS_MODES.register("sequence")
def tis_sequence(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-response behaviour weight to cap: log prod_t rho_t on every token of the response; [B, T] -> [B, T]."""
    return _sequence_log_ratio(log_rho)  # [B, T]


def tis_factor(log_rho: torch.Tensor, log_weight: torch.Tensor, cap: float) -> torch.Tensor:
    """The loss factor that turns the behaviour weight every policy loss carries per token (rho_t) into
    min(w, cap), w = exp(log_weight) (a TIS mode's weight): min(w, cap) / rho_t; [B, T] -> [B, T]."""
    return torch.exp(torch.clamp(log_weight, max=math.log(cap)) - log_rho)  # [B, T]


def _inside(log_value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return ((log_value >= math.log(low)) & (log_value <= math.log(high))).to(log_value.dtype)


@MIS_MODES.register("token")
def mis_token(log_rho: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Keep (1) the tokens with low <= rho_t <= high, drop (0) the others; [B, T] -> [B, T]."""
    return _inside(log_rho, low, high)  # [B, T]


@MIS_MODES.register("sequence")
def mis_sequence(log_rho: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Keep whole responses with low <= prod_t rho_t <= high; [B, T] -> [B, T]."""
    return _inside(_sequence_log_ratio(log_rho), low, high)  # [B, T]


@MIS_MODES.register("geometric")
def mis_geometric(log_rho: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Keep whole responses whose geometric-mean ratio exp(mean_t log rho_t) is in [low, high];
    length-normalised, so a long response is not rejected for its length alone. [B, T] -> [B, T]."""
    weights = mask.to(log_rho.dtype)  # [B, T]
    mean_log = (log_rho * weights).sum(dim=-1, keepdim=True) / weights.sum(dim=-1, keepdim=True).clamp_min(1.0)  # [B, 1]
    return _inside(mean_log, low, high).expand_as(log_rho)  # [B, T]


def correction_factors(log_rho: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings):
    """The per-token loss factor of the configured TIS and MIS, and which tokens each changed (TIS: the
    tokens whose weight the cap lowered).

    Returns (factor [B, T], truncated [B, T] bool, masked [B, T] bool); padding is never
    truncated or masked. With both off the factor is 1 everywhere."""
    valid = mask.bool()  # [B, T]
    factor = torch.ones_like(log_rho)  # [B, T]
    truncated = torch.zeros_like(valid)  # [B, T]
    masked = torch.zeros_like(valid)  # [B, T]
    if settings.tis != "none":
        log_weight = TIS_MODES.get(settings.tis)(log_rho, mask)  # [B, T]
        truncated = valid & (log_weight > math.log(settings.tis_cap))
        factor = factor * tis_factor(log_rho, log_weight, settings.tis_cap)
    if settings.mis != "none":
        keep = MIS_MODES.get(settings.mis)(log_rho, mask, low=settings.mis_low, high=settings.mis_high)  # [B, T]
        masked = valid & (keep == 0)
        factor = factor * keep
    return factor, truncated, masked


def _totals(log_rho: np.ndarray, truncated: np.ndarray, masked: np.ndarray) -> dict:
    """Additive sums (and max/min) over some valid tokens; all inputs [N]."""
    rho = np.exp(log_rho)  # [N]
    return {
        "tokens": int(log_rho.size), "rho_sum": float(rho.sum()),
        "k1_sum": float((-log_rho).sum()), "k3_sum": float(((rho - 1.0) - log_rho).sum()),
        "truncated": int(truncated.sum()), "masked": int(masked.sum()),
        "rho_max": float(rho.max()) if rho.size else -math.inf, "rho_min": float(rho.min()) if rho.size else math.inf,
    }


def mismatch_sums(log_rho: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                  truncated: torch.Tensor, masked: torch.Tensor) -> dict:
    """Mergeable mismatch statistics of one batch: log_rho, mask, truncated, masked [B, T];
    staleness [B] (train_step - policy_version of each response).

    KL(pi_behave || pi_prox) on tokens sampled from pi_behave, with r = rho = pi_prox / pi_behave:
    k1 = -log r, k3 = (r - 1) - log r (Schulman, "Approximating KL divergence").
    Returns {"all": totals, "staleness": {s: totals}, "sketch": rho at SKETCH_LEVELS}, plain Python."""
    # Statistics are computed on the host: a rank on a GPU hands its tensors over once, here.
    log_rho, mask, staleness, truncated, masked = (t.detach().cpu() for t in (log_rho, mask, staleness, truncated, masked))
    valid = mask.bool()  # [B, T]
    values = log_rho.double()[valid].numpy()  # [N]
    out = {"all": _totals(values, truncated[valid].numpy(), masked[valid].numpy()), "staleness": {},
           "sketch": np.exp(np.quantile(values, SKETCH_LEVELS)).tolist() if values.size else []}
    token_staleness = staleness.unsqueeze(-1).expand_as(valid)[valid].numpy()  # [N]
    for level in np.unique(token_staleness):
        at = token_staleness == level
        out["staleness"][int(level)] = _totals(values[at], truncated[valid].numpy()[at], masked[valid].numpy()[at])
    return out


def _merge_totals(parts: list[dict]) -> dict:
    merged = {key: sum(part[key] for part in parts) for key in ("tokens", "rho_sum", "k1_sum", "k3_sum",
                                                                "truncated", "masked")}
    merged["rho_max"] = max(part["rho_max"] for part in parts)
    merged["rho_min"] = min(part["rho_min"] for part in parts)
    return merged


def _metrics(totals: dict, suffix: str) -> dict:
    tokens = max(totals["tokens"], 1)
    return {
        f"is_ratio_mean{suffix}": totals["rho_sum"] / tokens, f"is_ratio_max{suffix}": totals["rho_max"],
        f"is_ratio_min{suffix}": totals["rho_min"], f"mismatch_k1{suffix}": totals["k1_sum"] / tokens,
        f"mismatch_k3{suffix}": totals["k3_sum"] / tokens, f"tis_fraction{suffix}": totals["truncated"] / tokens,
        f"mis_fraction{suffix}": totals["masked"] / tokens, f"is_tokens{suffix}": totals["tokens"],
    }


def merge_mismatch(parts: list[dict]) -> dict:
    """Per-step metrics from the `mismatch_sums` of every micro-batch on every rank.

    Means are token-weighted and exact (sums of sums), max/min exact. Quantiles are approximate:
    each part keeps rho at 101 evenly spaced quantile levels; the merged p50/p90/p99 are quantiles
    of the pooled sketch points, each weighted by its part's token count / 101, so they are exact
    for one part and within one percentile step of a part's distribution otherwise.
    Metric names: is_ratio_{mean,max,min,p50,p90,p99}, tis_fraction, mis_fraction, mismatch_k1,
    mismatch_k3, is_tokens, and the same (no quantiles) with suffix _staleness_{s} per staleness s."""
    parts = [part for part in parts if part["all"]["tokens"]]
    if not parts:
        return {}
    metrics = _metrics(_merge_totals([part["all"] for part in parts]), "")
    points = np.concatenate([np.asarray(part["sketch"]) for part in parts])
    weights = np.concatenate([np.full(len(SKETCH_LEVELS), part["all"]["tokens"] / len(SKETCH_LEVELS))
                              for part in parts])
    order = np.argsort(points)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    for name, level in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        metrics[f"is_ratio_{name}"] = float(points[order][min(np.searchsorted(cumulative, level), len(points) - 1)])
    levels = sorted({level for part in parts for level in part["staleness"]})
    for level in levels:
        metrics.update(_metrics(_merge_totals([part["staleness"][level] for part in parts
                                               if level in part["staleness"]]), f"_staleness_{level}"))
    return metrics
