"""The Advantage operator: per-response (or per-token) advantages for a Ray Data pipeline, from the
estimators and reward shaping of operators/algorithms/estimators.py."""

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List

import numpy as np

from operators.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ESTIMATORS,
    episode_token_rewards,
    estimator_kind,
    masked_token_estimate,
    outcome_token_rewards,
    overlong_shaping,
    sequence_kl_penalty,
)

if TYPE_CHECKING:
    import pandas


class Advantage:
    """Ray Data `map_batches` operator adding per-response advantages.

    Input: a pandas DataFrame, one row per prompt group, with a "rewards"
    column whose cells are length-n sequences of floats (and "response_lengths"
    when overlong shaping is on). Output: the same frame plus "advantages" (list
    of n python floats per row), "overlong_shaped" (how many of the row's
    responses the overlong shaping changed) and "time_advantage" (seconds spent
    in this call / number of rows, so the per-row value sums back to the call's cost).

    With `overlong_buffer` > 0 the DAPO overlong shaping is added to the rewards
    before the estimator sees them (lengths: the policy's tokens of a multi-turn episode); with
    `kl_reward_coef` > 0 the KL to the reference is subtracted (rows need "behavior_logprobs" and
    "ref_logprobs", from the RefLogprob stage): from an outcome estimator's reward as kl_reward_coef x
    `sequence_kl_penalty`, from a token estimator's token rewards per token (kl_reward_coef x k1_t at
    each policy token, as verl and OpenRLHF do); the row's mean summed penalty goes to
    "kl_reward_penalty". The "rewards" column keeps the task reward.

    Rows with different n cannot share a [G, n] array, so rows are grouped by
    n and each subset goes through the estimator separately (estimators are
    per group; reinforce_pp_baseline's whitening happens later, per step).

    A token estimator (gae) also needs "values" (one list per response, one value per
    response token: the Value stage's) and adds "returns" (same nesting); its advantages are
    then one list per response token. Whitening, if any, happens per step in Train.
    """

    def __init__(self, estimator: str = "grpo", eps: float = 1e-6, max_new_tokens: int = 0,
                 overlong_buffer: int = 0, overlong_penalty: float = 1.0, gamma: float = 1.0,
                 gae_lambda: float = 1.0, kl_reward_coef: float = 0.0):
        self.estimator = estimator
        self.eps = eps
        self.kl_reward_coef = float(kl_reward_coef)
        self.kind = estimator_kind(estimator)  # KeyError for unknown names
        self._fn = (TOKEN_ESTIMATORS if self.kind == "token" else ADVANTAGE_ESTIMATORS).get(estimator)
        self.discount = {"gamma": gamma, "lam": gae_lambda}
        self.shaping = {"max_new_tokens": max_new_tokens, "buffer": overlong_buffer, "penalty": overlong_penalty}

    def __call__(self, batch: "pandas.DataFrame") -> "pandas.DataFrame":
        import pandas as pd  # only the operator needs pandas; estimators stay numpy-only

        start = time.perf_counter()
        out = batch.copy()
        rewards = [np.asarray(r, dtype=np.float64) for r in batch["rewards"]]
        shaped = [0] * len(batch)
        token_kl = None  # a token estimator's per-token KL penalty, one [T] array per response
        if self.shaping["buffer"] > 0:  # the policy's tokens: a multi-turn episode's observations do not count
            lengths = (batch["response_lengths"] if "loss_masks" not in batch.columns else
                       [[int(np.sum(mask)) for mask in masks] for masks in batch["loss_masks"]])
            shaping = [overlong_shaping(row_lengths, **self.shaping) for row_lengths in lengths]
            rewards = [r + s for r, s in zip(rewards, shaping)]
            shaped = [int((s != 0).sum()) for s in shaping]
        if self.kl_reward_coef > 0:
            if "ref_logprobs" not in batch.columns:
                raise ValueError("kl_reward_coef > 0 needs a ref_logprobs column: put the RefLogprob stage "
                                 "before Advantage (a `reference` section in the job config)")
            masks = batch["loss_masks"] if "loss_masks" in batch.columns else [None] * len(batch)
            penalties = [sequence_kl_penalty(b, r, m)
                         for b, r, m in zip(batch["behavior_logprobs"], batch["ref_logprobs"], masks)]
            if self.kind == "token":  # per token (verl, OpenRLHF): r_t = -coef x k1_t, the outcome on the last
                token_kl = [[self.kl_reward_coef * (np.asarray(b, dtype=np.float64) - np.asarray(r, dtype=np.float64))
                             for b, r in zip(row_b, row_r)]
                            for row_b, row_r in zip(batch["behavior_logprobs"], batch["ref_logprobs"])]
            else:  # an outcome estimator sees one reward per response: the summed penalty
                rewards = [r - self.kl_reward_coef * p for r, p in zip(rewards, penalties)]
            out["kl_reward_penalty"] = pd.Series([float(p.mean()) for p in penalties], index=out.index, dtype=np.float64)
        if self.kind == "token":
            episodes = (zip(batch["loss_masks"], batch["turns"]) if "loss_masks" in batch.columns
                        else [(None, None)] * len(batch))
            advantages, returns = self._token_advantages(rewards, batch["values"], episodes, token_kl)
            out["returns"] = pd.Series(returns, index=out.index, dtype=object)
        else:
            advantages = self._row_advantages(rewards) if len(batch) else []
        # dtype=object keeps each cell a list instead of pandas expanding to 2-D.
        out["advantages"] = pd.Series(advantages, index=out.index, dtype=object)
        out["overlong_shaped"] = pd.Series(shaped, index=out.index, dtype=np.int64)
        per_row = (time.perf_counter() - start) / len(batch) if len(batch) else 0.0
        out["time_advantage"] = pd.Series(per_row, index=out.index, dtype=np.float64)
        return out

    def _token_advantages(self, rewards_per_row: List, values_per_row, episodes, token_kl=None) -> tuple[List, List]:
        """Per row, per response: (advantages, returns), lists of floats per response token. Multi-turn
        rows (`episodes`: their loss_masks and turns) are estimated over the policy's tokens, with each
        turn's environment reward on that turn's last token (episode_token_rewards). `token_kl` (per row,
        per response, [T]): a KL penalty subtracted from the token rewards (at the policy's tokens)."""
        import json

        advantages, returns = [], []
        for row, (rewards, values, (masks, turns)) in enumerate(zip(rewards_per_row, values_per_row, episodes)):
            kl = token_kl[row] if token_kl is not None else [0.0] * len(rewards)
            if masks is None:
                pairs = [self._fn(outcome_token_rewards(reward, len(response_values)) - penalty, response_values,
                                  **self.discount)
                         for reward, response_values, penalty in zip(rewards, values, kl)]
            else:
                pairs = [masked_token_estimate(
                    self._fn, episode_token_rewards(reward, mask, [t.get("reward") for t in json.loads(turn)])
                    - (np.asarray(penalty)[np.asarray(mask, dtype=bool)] if np.ndim(penalty) else penalty),
                    response_values, mask, **self.discount)
                    for reward, response_values, mask, turn, penalty in zip(rewards, values, masks, turns, kl)]
            advantages.append([adv.tolist() for adv, _ in pairs])
            returns.append([ret.tolist() for _, ret in pairs])
        return advantages, returns

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
