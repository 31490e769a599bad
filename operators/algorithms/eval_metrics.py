"""Evaluation metrics: pure functions over scored prompt groups (rows from Generate -> Reward).

A scored row holds one prompt and its responses with `rewards` (one per response) and
`response_lengths`. Sampled rows have `n` responses each; greedy rows have one. The
summary is what the RL job logs as `eval/*` and what `streamrl eval` reports.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021): the chance that at least one of k
    responses drawn without replacement from `n` samples, `c` of them correct, is correct.

        pass@k = 1 - C(n - c, k) / C(n, k)

    computed as a product so large n does not overflow. Needs 1 <= k <= n, 0 <= c <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k responses contains a correct one
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks = [1 << e for e in range(n.bit_length()) if 1 << e <= n]
    return ks + ([n] if n and ks[-1] != n else [])


def _flat(rows: pd.DataFrame, column: str) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=float) for v in rows[column]]) if len(rows) else np.array([])


FORMAT_COLUMN = "reward_answer_format"  # the answer_format reward's per-sample scores (operators/stages/reward.py)


def answered_metrics(rows: pd.DataFrame, success_threshold: float = 1.0, prefix: str = "") -> dict:
    """With an `answer_format` reward: the share of samples that state an answer in the asked format
    (`answered_rate`) and the success rate among those (`success_among_answered`, NaN when none did), so a
    rise that is only the format shows as such. Empty without that reward."""
    if rows.empty or FORMAT_COLUMN not in rows.columns:
        return {}
    answered = _flat(rows, FORMAT_COLUMN) > 0
    success = _flat(rows, "rewards") >= success_threshold
    return {f"{prefix}answered_rate": float(answered.mean()),
            f"{prefix}success_among_answered": float(success[answered].mean()) if answered.any() else float("nan")}


def summarize_sampled(rows: pd.DataFrame, success_threshold: float = 1.0, prefix: str = "eval/") -> dict:
    """reward_mean, success_rate (over all samples), pass@k per `pass_at_ks(n)` (named pass_at_K: MLflow
    refuses '@' in a metric name), response_length_mean.

    `rows`: one per prompt, each with the same number n of responses."""
    if rows.empty:
        return {}
    sizes = {len(r) for r in rows["rewards"]}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples for pass@k, got sizes {sorted(sizes)}")
    n = sizes.pop()
    correct = [int((np.asarray(r, dtype=float) >= success_threshold).sum()) for r in rows["rewards"]]  # [P]
    rewards = _flat(rows, "rewards")  # [P * n]
    metrics = {
        f"{prefix}reward_mean": float(rewards.mean()),
        f"{prefix}success_rate": float((rewards >= success_threshold).mean()),
        f"{prefix}response_length_mean": float(_flat(rows, "response_lengths").mean()),
        **answered_metrics(rows, success_threshold, prefix),
    }
    for k in pass_at_ks(n):
        metrics[f"{prefix}pass_at_{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))  # pass@k
    return metrics


def summarize_greedy(rows: pd.DataFrame, success_threshold: float = 1.0, prefix: str = "eval/") -> dict:
    """greedy_reward_mean, greedy_success_rate, greedy_response_length_mean over one response per prompt."""
    if rows.empty:
        return {}
    rewards = _flat(rows, "rewards")  # [P]
    return {
        f"{prefix}greedy_reward_mean": float(rewards.mean()),
        f"{prefix}greedy_success_rate": float((rewards >= success_threshold).mean()),
        f"{prefix}greedy_response_length_mean": float(_flat(rows, "response_lengths").mean()),
        **answered_metrics(rows, success_threshold, f"{prefix}greedy_"),
    }


def summarize(scored: pd.DataFrame, success_threshold: float = 1.0, prefix: str = "eval/") -> dict:
    """All eval metrics of scored rows with a `mode` column ("sampled" or "greedy"), plus
    num_prompts and the policy version(s) evaluated (min and max of `policy_version`)."""
    sampled = scored[scored["mode"] == "sampled"]
    greedy = scored[scored["mode"] == "greedy"]
    versions = scored["policy_version"].astype(int)
    return {
        **summarize_sampled(sampled, success_threshold, prefix),
        **summarize_greedy(greedy, success_threshold, prefix),
        f"{prefix}num_prompts": int(scored["prompt_id"].nunique()),
        f"{prefix}policy_version": int(versions.max()),
        f"{prefix}policy_version_min": int(versions.min()),
    }
