"""Advantage estimators and reward shaping: pure numpy maths, apart from the operator that uses them
(operators/stages/advantage.py, `Advantage`).

Two kinds, each with its registry:

* outcome estimators (`ADVANTAGE_ESTIMATORS`: grpo, rloo, ...) map per-response scalar
  rewards of shape [G, n] (G prompt groups, n sampled responses per prompt) to one advantage
  per response, also [G, n] float64; the trainer broadcasts it over the response tokens;
* token estimators (`TOKEN_ESTIMATORS`: gae) map one response's per-token rewards [T] and
  the critic's per-token values [T] to per-token advantages and return targets, both [T]
  (the critic's training targets). They need a `values` column (operators.stages.value.Value).

`estimator_kind(name)` says which kind a name is; the Advantage operator dispatches on it.
"""

from typing import List

import numpy as np

from operators.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
TOKEN_ESTIMATORS = Registry("token-level advantage estimator")


def estimator_kind(name: str) -> str:
    """"outcome" (per-response, from rewards alone) or "token" (per token, needs a critic's values)."""
    if name in TOKEN_ESTIMATORS:
        return "token"
    ADVANTAGE_ESTIMATORS.get(name)  # KeyError naming the known outcome estimators
    return "outcome"


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
    """REINFORCE++ with group baseline (Hu 2025, "REINFORCE++"), its per-group part.

        x_i   = r_i - mean_{group} r                       (here)
        A_i   = (x_i - mean_{step} x) / (std_{step} x + eps)  (whiten_over_step, in Train)

    The whitening must see the whole train step (every group, every rank): done on one call's
    rows it would make `rollout.groups_per_call` change the algorithm. So this estimator stops
    at the group baseline and is listed in STEP_WHITENED; the Train operator whitens each step's
    advantages before training on them. `eps` is accepted for a uniform signature.
    """
    return _centered(_as_groups(rewards))  # [G, n]


# Estimators whose advantages are finished by whiten_over_step over a whole train step.
STEP_WHITENED = frozenset({"reinforce_pp_baseline"})


def outcome_token_rewards(reward: float, length: int) -> np.ndarray:
    """Per-token rewards of one response: the outcome reward on its last token, 0 elsewhere; [T]."""
    rewards = np.zeros(length, dtype=np.float64)  # [T]
    if length:
        rewards[-1] = reward
    return rewards


def episode_token_rewards(reward: float, loss_mask, turn_rewards) -> np.ndarray:
    """Per-token rewards of a multi-turn episode, at its policy tokens only ([P], P = sum(loss_mask)):
    each turn's environment reward on the last token of that turn, the rest of `reward` (the episode's
    total, which includes them) on the last policy token. Turns are the runs of 1s in `loss_mask`."""
    mask = np.asarray(loss_mask, dtype=bool)  # [T]
    rewards = np.zeros(int(mask.sum()), dtype=np.float64)  # [P]
    if not len(rewards):
        return rewards
    ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]  # turn ends, in [T]
    positions = np.cumsum(mask) - 1  # [T]: index among the policy tokens
    placed = 0.0
    for end, turn_reward in zip(ends, turn_rewards):
        if turn_reward:
            rewards[positions[end]] += float(turn_reward)
            placed += float(turn_reward)
    rewards[-1] += reward - placed
    return rewards


def masked_token_estimate(fn, token_rewards: np.ndarray, values, loss_mask, **discount) -> tuple[np.ndarray, np.ndarray]:
    """A token estimator over the policy tokens of an episode only (observation tokens are not actions:
    no step of the return passes through them); (advantages, returns) back on every response token,
    advantage 0 and return = value at the observation tokens (which the loss masks out anyway)."""
    mask = np.asarray(loss_mask, dtype=bool)  # [T]
    values = np.asarray(values, dtype=np.float64)  # [T]
    advantages, returns = np.zeros(len(mask)), values.copy()  # [T] each
    if mask.any():
        advantages[mask], returns[mask] = fn(token_rewards, values[mask], **discount)
    return advantages, returns


@TOKEN_ESTIMATORS.register("gae")
def gae(token_rewards: np.ndarray, values: np.ndarray, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016) over one response of T tokens.

        delta_t = r_t + gamma * V_{t+1} - V_t          (V_T = 0: the episode ends with the last token)
        A_t     = delta_t + gamma * lam * A_{t+1}      (A_T = 0)
        R_t     = A_t + V_t                            (the critic's return target)

    V_t is the critic's value of the state before token t (prompt + tokens < t). lam = 1 gives
    Monte-Carlo returns minus the value baseline; lam = 0 the one-step TD error.
    Returns (advantages [T], returns [T]), float64.
    """
    token_rewards = np.asarray(token_rewards, dtype=np.float64)  # [T]
    values = np.asarray(values, dtype=np.float64)  # [T]
    if token_rewards.shape != values.shape or token_rewards.ndim != 1:
        raise ValueError(f"token rewards {token_rewards.shape} and values {values.shape} must both be [T]")
    next_values = np.append(values[1:], 0.0)  # [T]: V_{t+1}, 0 after the last token
    deltas = token_rewards + gamma * next_values - values  # [T]
    advantages = np.zeros_like(deltas)  # [T]
    running = 0.0
    for t in reversed(range(len(deltas))):
        running = deltas[t] + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values  # [T], [T]


def whiten_over_step(advantages: List[List], token_masks: List[List] | None = None, *,
                     eps: float = 1e-6) -> List[List]:
    """(x - mean) / (std + eps) over one train step (population std, ddof=0), over its trained tokens.

    `advantages` holds one list per group with one entry per response: a float (the response's
    advantage, on each of its tokens) or a list of floats (one per response token, e.g. GAE).
    `token_masks` (same nesting, one 0/1 list per response, one entry per response token): which
    tokens the loss trains (a multi-turn episode's loss mask; all 1s otherwise). Mean and std are
    then over those tokens: a float counts once per trained token of its response, a per-token
    list only at its 1s (observation tokens carry no advantage), which is verl's `masked_whiten`
    and OpenRLHF's whitening over the action mask. Per-token lists come back with 0.0 where the
    mask is 0. Without `token_masks` every float and every list entry counts once (response
    weighting for floats). Returns the same nesting, floats.
    """
    values, weights = [], []
    for g, group in enumerate(advantages):
        for r, entry in enumerate(group):
            entry = np.atleast_1d(np.asarray(entry, dtype=np.float64))  # [1] or [T]
            mask = np.ones(len(entry)) if token_masks is None else np.asarray(token_masks[g][r], dtype=np.float64)
            if len(entry) != len(mask) and len(entry) != 1:
                raise ValueError(f"group {g} response {r}: {len(entry)} advantages for {len(mask)} token mask entries")
            values.append(entry)
            weights.append(mask if len(entry) == len(mask) else np.array([mask.sum()]))  # a float: once per token
    values, weights = np.concatenate(values), np.concatenate(weights)  # [N] each
    total = weights.sum()
    if total <= 0:  # nothing is trained this step: nothing to whiten
        return [[float(e) if np.ndim(e) == 0 else [float(v) for v in e] for e in group] for group in advantages]
    mean = float((values * weights).sum() / total)
    std = float(np.sqrt((weights * (values - mean) ** 2).sum() / total))

    def whiten(entry, mask):
        scaled = (np.asarray(entry, dtype=np.float64) - mean) / (std + eps)
        if not scaled.ndim:
            return float(scaled)
        if mask is not None and len(mask) == len(scaled):
            scaled = np.where(np.asarray(mask, dtype=bool), scaled, 0.0)
        return scaled.tolist()

    return [[whiten(entry, None if token_masks is None else token_masks[g][r]) for r, entry in enumerate(group)]
            for g, group in enumerate(advantages)]


def policy_token_budget(max_new_tokens: int, max_turns: int | None = None,
                        max_episode_tokens: int | None = None) -> int:
    """The most tokens the policy can write in one response: `max_new_tokens`, or in a multi-turn episode
    min(max_turns x max_new_tokens, max_episode_tokens) (the episode's budget counts the observations
    too, so this bounds the policy's share). The length budget of DAPO's overlong shaping and Dr. GRPO's
    constant normaliser."""
    if max_turns is None:
        return int(max_new_tokens)
    budget = int(max_turns) * int(max_new_tokens)
    return budget if max_episode_tokens is None else min(budget, int(max_episode_tokens))


def overlong_shaping(lengths: np.ndarray, *, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO soft overlong punishment (Yu et al. 2025), added to the reward; lengths [N] -> [N].

        L_max = max_new_tokens, L_cache = buffer
        shaping = 0                                          if |y| <= L_max - L_cache
                = -penalty * (|y| - (L_max - L_cache)) / L_cache   if |y| >  L_max - L_cache

    so it falls linearly from 0 to -penalty at |y| = L_max, and stays there beyond (a floor: a length
    counted past the budget is punished no more than one at it). buffer 0 turns it off (zeros).
    |y| counts the policy's tokens and L_max is the policy's budget: in a multi-turn episode the
    tokens of its turns (not the observations) against the episode's budget for them
    (`policy_token_budget`), not one turn's max_new_tokens.
    """
    lengths = np.asarray(lengths, dtype=np.float64)  # [N]
    if buffer <= 0:
        return np.zeros_like(lengths)
    over = np.clip(lengths - (max_new_tokens - buffer), 0.0, buffer)  # [N]
    return -penalty * over / buffer  # [N]


def sequence_kl_penalty(behavior_logprobs: List[List[float]], ref_logprobs: List[List[float]],
                        loss_masks: List[List[int]] | None = None) -> np.ndarray:
    """KL to the reference as a reward penalty, per response: the sum over its tokens of the k1
    estimate log pi_behave - log pi_ref (its expectation is the sequence-level KL); [n] lists -> [n].
    `loss_masks` (multi-turn episodes): only the policy's tokens count, not the observations.

    Subtracted (times a coefficient) from the outcome reward before the advantage, as verl and
    OpenRLHF do with a KL "in the reward"; `algorithm.kl_coef` puts it in the loss instead."""
    if len(behavior_logprobs) != len(ref_logprobs):
        raise ValueError(f"{len(behavior_logprobs)} responses but {len(ref_logprobs)} reference log-prob lists")
    masks = loss_masks if loss_masks is not None else [None] * len(behavior_logprobs)
    return np.array([
        float(np.sum((np.asarray(b, dtype=np.float64) - np.asarray(r, dtype=np.float64))  # sum_t k1
                     * (1.0 if m is None else np.asarray(m, dtype=np.float64))))
        for b, r, m in zip(behavior_logprobs, ref_logprobs, masks)
    ])  # [n]
