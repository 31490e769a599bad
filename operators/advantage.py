"""Outcome-reward advantage estimators (pure numpy) and a Ray-Data-style operator.

Every estimator maps per-response scalar rewards of shape [G, n] (G prompt
groups, n sampled responses per prompt) to one advantage per response, also
[G, n] float64; the trainer broadcasts it over the response tokens later.
Estimators are looked up by name through `ADVANTAGE_ESTIMATORS`.
"""

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List

import numpy as np

from .registry import Registry

if TYPE_CHECKING:
    import pandas

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def _as_groups(rewards: np.ndarray) -> np.ndarray:
    """Validate and convert rewards to a float64 [G, n] array."""
    rewards = np.asarray(rewards, dtype=np.float64)  # [G, n]
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [G, n], got shape {rewards.shape}")
    return rewards


def _centered(rewards: np.ndarray) -> np.ndarray:
    """r - group mean, per row."""
    return rewards - rewards.mean(axis=1, keepdims=True)  # [G, n]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    """GRPO group-normalised advantage (DeepSeekMath, Shao et al. 2024).

        A_i = (r_i - mean_j r_j) / (std_j r_j + eps)

    std is the unbiased sample std (ddof=1), matching verl / torch.std.
    A group of one response has no spread to compare against, so it gets 0
    (ddof=1 would otherwise divide by zero). A group of identical rewards
    gives 0 / eps = 0.
    """
    rewards = _as_groups(rewards)  # [G, n]
    if rewards.shape[1] == 1:
        return np.zeros_like(rewards)
    std = rewards.std(axis=1, ddof=1, keepdims=True)  # [G, 1]
    return _centered(rewards) / (std + eps)  # [G, n]


@ADVANTAGE_ESTIMATORS.register("grpo_no_std")
def grpo_no_std(rewards: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    """GRPO without std normalisation (DeepSeekMath, Shao et al. 2024, minus the std).

        A_i = r_i - mean_j r_j

    `eps` is accepted only so every estimator has the same signature.
    """
    return _centered(_as_groups(rewards))  # [G, n]


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    """Dr. GRPO advantage ("Understanding R1-Zero-Like Training", Liu et al. 2025).

        A_i = r_i - mean_j r_j

    Dr. GRPO drops the std division (it up-weights too-easy / too-hard groups).
    Its other fix, the length-independent loss aggregation, lives in
    `losses.seq_mean_token_sum_norm`. Registered separately so configs can say
    what they mean.
    """
    return grpo_no_std(rewards, eps=eps)  # [G, n]


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics").

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_j r_j)

    A group of one response has no other sample to use as baseline, so it
    gets 0. `eps` is accepted only for a uniform signature.
    """
    rewards = _as_groups(rewards)  # [G, n]
    n = rewards.shape[1]
    if n == 1:
        return np.zeros_like(rewards)
    loo_mean = (rewards.sum(axis=1, keepdims=True) - rewards) / (n - 1)  # [G, n]
    return rewards - loo_mean  # [G, n]


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: np.ndarray, *, eps: float = 1e-6) -> np.ndarray:
    """REINFORCE++ with group baseline (Hu 2025, "REINFORCE++").

        x_i   = r_i - mean_{group} r
        A_i   = (x_i - mean_{batch} x) / (std_{batch} x + eps)

    The second step whitens over ALL G*n responses of the array passed in
    (population std, ddof=0): "batch" means exactly the rows given in one
    call, so results depend on how the caller batches prompt groups.
    """
    centered = _centered(_as_groups(rewards))  # [G, n]
    return (centered - centered.mean()) / (centered.std() + eps)  # [G, n]


class Advantage:
    """Ray Data `map_batches` operator adding per-response advantages.

    Input: a pandas DataFrame, one row per prompt group, with a "rewards"
    column whose cells are length-n sequences of floats. Output: the same
    frame plus "advantages" (list of n python floats per row) and
    "time_advantage" (seconds spent in this call / number of rows, so the
    per-row value sums back to the call's cost).

    Rows with different n cannot share a [G, n] array, so rows are grouped by
    n and each subset goes through the estimator separately; batch-whitening
    estimators (reinforce_pp_baseline) therefore whiten within each subset.
    """

    def __init__(self, estimator: str = "grpo", eps: float = 1e-6):
        self.estimator = estimator
        self.eps = eps
        self._fn = ADVANTAGE_ESTIMATORS.get(estimator)  # KeyError for unknown names

    def __call__(self, batch: "pandas.DataFrame") -> "pandas.DataFrame":
        import pandas as pd  # only the operator needs pandas; estimators stay numpy-only

        start = time.perf_counter()
        out = batch.copy()
        advantages = self._row_advantages(list(batch["rewards"])) if len(batch) else []
        # dtype=object keeps each cell a list instead of pandas expanding to 2-D.
        out["advantages"] = pd.Series(advantages, index=out.index, dtype=object)
        per_row = (time.perf_counter() - start) / len(batch) if len(batch) else 0.0
        out["time_advantage"] = pd.Series(per_row, index=out.index, dtype=np.float64)
        return out

    def _row_advantages(self, rewards_per_row: List) -> List[List[float]]:
        """Advantages per row, computing each same-n subset as one [G, n] array."""
        rows_by_n: Dict[int, List[int]] = defaultdict(list)
        for row, rewards in enumerate(rewards_per_row):
            rows_by_n[len(rewards)].append(row)

        advantages: List[List[float]] = [[] for _ in rewards_per_row]
        for rows in rows_by_n.values():
            group = np.asarray([rewards_per_row[r] for r in rows], dtype=np.float64)  # [g, n]
            for row, adv in zip(rows, self._fn(group, eps=self.eps)):  # adv: [n]
                advantages[row] = adv.tolist()
        return advantages
