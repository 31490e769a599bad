"""Reference tests: every registered algorithm piece against its paper / reference formula.

Each test computes the expected value INDEPENDENTLY, written here from the formula (plain Python
loops over numbers, numpy or torch arithmetic), never by calling other project code, and compares
the project's function with it on small fixed inputs: single-turn batches (right padding) and
masked multi-turn batches (a loss mask such as [1, 1, 0, 0, 1, 1, 0, 0]: policy tokens, observation
tokens, policy tokens, right padding). Where a quantity is split over data-parallel ranks or
micro-batches, the split with global normalisers is checked to give the whole batch's value.

References, cited per test: DeepSeekMath (GRPO), Dr. GRPO, RLOO ("Back to Basics"), REINFORCE++,
GAE (Schulman et al. 2016), PPO (Schulman et al. 2017), decoupled PPO (Hilton et al. 2022; AReaL),
dual-clip PPO (Ye et al. 2020), GSPO (Zheng et al. 2025), DAPO (Yu et al. 2025), Schulman's
"Approximating KL divergence" (k1/k2/k3), verl `core_algos` (masked_whiten, multi-turn GAE,
compute_value_loss, agg_loss) and verl rollout correction (TIS/MIS), OpenRLHF (whitening over the
action mask, value loss).
"""

import math

import numpy as np
import pytest
import torch

from operators.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    TOKEN_ESTIMATORS,
    episode_token_rewards,
    gae,
    masked_token_estimate,
    overlong_shaping,
    policy_token_budget,
    sequence_kl_penalty,
    whiten_over_step,
)
from operators.algorithms.correction import (
    MIS_MODES,
    TIS_MODES,
    CorrectionSettings,
    behavior_log_ratio,
    correction_factors,
    tis_factor,
)
from operators.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    VALUE_LOSSES,
)

TOL = dict(atol=1e-9, rtol=1e-9)


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def _rows(tensor):
    """A [B, T] tensor as nested Python lists (the references below loop over plain floats)."""
    return tensor.detach().tolist()


# Masks shared by the torch tests. Single-turn: right padding only. Multi-turn: policy tokens,
# observation tokens (0 in the middle), policy tokens, right padding.
SINGLE_MASK = [[1, 1, 1, 1, 0, 0],
               [1, 1, 1, 1, 1, 1]]
MULTI_MASK = [[1, 1, 0, 0, 1, 1, 0, 0],
              [1, 0, 0, 1, 1, 1, 1, 0]]


# =================================================================== registries are all covered

# Every registered name has a reference test in this file; a new registration must add one.
COVERED = {
    "ADVANTAGE_ESTIMATORS": {"grpo", "grpo_no_std", "dr_grpo", "rloo", "reinforce_pp_baseline"},
    "TOKEN_ESTIMATORS": {"gae"},
    "POLICY_LOSSES": {"ppo_clip", "decoupled_ppo", "gspo"},
    "LOSS_AGGREGATIONS": {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"},
    "KL_ESTIMATORS": {"k1", "k2", "k3"},
    "VALUE_LOSSES": {"clipped"},
    "TIS_MODES": {"token", "sequence"},
    "MIS_MODES": {"token", "sequence", "geometric"},
}


@pytest.mark.parametrize("name, registry", [
    ("ADVANTAGE_ESTIMATORS", ADVANTAGE_ESTIMATORS), ("TOKEN_ESTIMATORS", TOKEN_ESTIMATORS),
    ("POLICY_LOSSES", POLICY_LOSSES), ("LOSS_AGGREGATIONS", LOSS_AGGREGATIONS),
    ("KL_ESTIMATORS", KL_ESTIMATORS), ("VALUE_LOSSES", VALUE_LOSSES),
    ("TIS_MODES", TIS_MODES), ("MIS_MODES", MIS_MODES),
])
def test_every_registered_name_has_a_reference_test(name, registry):
    """Bookkeeping, no paper: the registries hold exactly the names this file checks."""
    assert set(registry.names()) == COVERED[name]


# =================================================================== outcome advantage estimators

REWARDS = [[1.0, 0.0, 0.0, 1.0],
           [0.3, 2.0, -1.0, 0.7],
           [0.5, 0.5, 0.5, 0.5]]  # identical rewards: no signal


def _group_mean(group):
    return sum(group) / len(group)


def _sample_std(group):
    mean = _group_mean(group)
    return math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))


def test_grpo_reference():
    """GRPO (DeepSeekMath, Shao et al. 2024, outcome supervision; verl core_algos
    compute_grpo_outcome_advantage): A_i = (r_i - mean_j r_j) / (std_j r_j + eps), std with Bessel's
    correction (torch.std). A group of one response has no baseline and gets 0 (a deliberate choice:
    verl instead uses mean 0, std 1 there, i.e. A = r)."""
    eps = 1e-6
    expected = [[(r - _group_mean(g)) / (_sample_std(g) + eps) for r in g] for g in REWARDS]
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS.get("grpo")(np.array(REWARDS), eps=eps), expected, **TOL)
    np.testing.assert_array_equal(ADVANTAGE_ESTIMATORS.get("grpo")(np.array([[3.0], [-1.0]])), [[0.0], [0.0]])


@pytest.mark.parametrize("name", ["grpo_no_std", "dr_grpo"])
def test_grpo_no_std_and_dr_grpo_reference(name):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", Eq. of the unbiased
    advantage) and GRPO without the std (verl norm_adv_by_std_in_grpo=False): A_i = r_i - mean_j r_j."""
    expected = [[r - _group_mean(g) for r in g] for g in REWARDS]
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS.get(name)(np.array(REWARDS)), expected, **TOL)


def test_rloo_reference():
    """RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): the baseline of response i
    is the mean reward of the OTHER n-1 responses: A_i = r_i - 1/(n-1) sum_{j != i} r_j. Groups of
    one get 0 (verl leaves the raw reward there)."""
    expected = [[r - sum(o for j, o in enumerate(g) if j != i) / (len(g) - 1) for i, r in enumerate(g)]
                for g in REWARDS]
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS.get("rloo")(np.array(REWARDS)), expected, **TOL)
    np.testing.assert_array_equal(ADVANTAGE_ESTIMATORS.get("rloo")(np.array([[3.0]])), [[0.0]])


def test_reinforce_pp_baseline_reference():
    """REINFORCE++ with baseline (Hu 2025; verl compute_reinforce_plus_plus_baseline_outcome_advantage),
    its per-group part: x_i = r_i - group mean (the step-level whitening is whiten_over_step, below)."""
    expected = [[r - _group_mean(g) for r in g] for g in REWARDS]
    np.testing.assert_allclose(ADVANTAGE_ESTIMATORS.get("reinforce_pp_baseline")(np.array(REWARDS)), expected, **TOL)


# =================================================================== whitening over the step


def _weighted_whiten(pairs, eps):
    """Reference (x - mean) / (std + eps) with mean and population std over (value, weight) pairs."""
    total = sum(w for _, w in pairs)
    mean = sum(v * w for v, w in pairs) / total
    std = math.sqrt(sum(w * (v - mean) ** 2 for v, w in pairs) / total)
    return (lambda x: (x - mean) / (std + eps)), mean, std


def test_whiten_over_step_token_weighting_of_response_advantages():
    """REINFORCE++ (Hu 2025) whitens the advantage over the batch's TOKENS: verl's masked_whiten on
    scores * response_mask, OpenRLHF's whitening over the action mask. A response's scalar advantage
    counts once per trained token. Here one response has 1 token and one has 9: token weighting
    and response weighting (no masks) give different means, and both match their own reference."""
    advantages = [[1.0, -1.0], [0.5]]
    masks = [[[1], [1] * 9], [[1, 1, 0, 0, 1, 1, 0, 0]]]  # the last: a multi-turn episode, 4 trained tokens
    eps = 1e-6

    # token weighting: every trained token carries its response's advantage
    tokens = [(1.0, 1)] + [(-1.0, 1)] * 9 + [(0.5, 1)] * 4
    whiten, token_mean, _ = _weighted_whiten(tokens, eps)
    out = whiten_over_step(advantages, masks, eps=eps)
    np.testing.assert_allclose(out[0], [whiten(1.0), whiten(-1.0)], **TOL)
    np.testing.assert_allclose(out[1], [whiten(0.5)], **TOL)
    assert all(type(v) is float for group in out for v in group)

    # response weighting (no masks): each float once
    whiten_r, response_mean, _ = _weighted_whiten([(1.0, 1), (-1.0, 1), (0.5, 1)], eps)
    out_r = whiten_over_step(advantages, eps=eps)
    np.testing.assert_allclose(out_r[0] + out_r[1], [whiten_r(1.0), whiten_r(-1.0), whiten_r(0.5)], **TOL)
    assert token_mean == pytest.approx((1.0 - 9.0 + 4 * 0.5) / 14) and response_mean == pytest.approx(0.5 / 3)
    assert not np.allclose(out[0], out_r[0])


def test_whiten_over_step_per_token_gae_lists_with_observation_tokens():
    """verl core_algos masked_whiten (GAE advantages whitened over response_mask) / OpenRLHF's
    whitening over the action mask: mean and population std over the policy tokens only (the
    observation and padding tokens, mask 0, neither count nor keep a value: they come back 0).
    After whitening the policy tokens have mean 0 and std 1 (up to eps) exactly."""
    advantages = [[[0.3, -0.2, 99.0, 99.0, 1.1, 0.4, 77.0, 77.0], [2.0, 0.0, -1.0]],
                  [[-0.7, 5.0, 0.9]]]
    masks = [[[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1]],
             [[1, 0, 1]]]
    eps = 1e-8
    pairs = [(v, m) for group, group_masks in zip(advantages, masks)
             for entry, mask in zip(group, group_masks) for v, m in zip(entry, mask)]
    whiten, _, _ = _weighted_whiten(pairs, eps)
    out = whiten_over_step(advantages, masks, eps=eps)
    for group, group_masks, out_group in zip(advantages, masks, out):
        for entry, mask, out_entry in zip(group, group_masks, out_group):
            np.testing.assert_allclose(out_entry, [whiten(v) if m else 0.0 for v, m in zip(entry, mask)], **TOL)
    policy = np.array([v for group, group_masks in zip(out, masks) for entry, mask in zip(group, group_masks)
                       for v, m in zip(entry, mask) if m])
    assert len(policy) == 9
    assert policy.mean() == pytest.approx(0.0, abs=1e-12)
    assert policy.std() == pytest.approx(1.0, abs=1e-6)


def test_whiten_over_step_without_masks_counts_every_list_entry():
    """OpenRLHF / verl whitening of per-token advantages when every token is trained: plain mean and
    population std over all entries (a float counts once)."""
    advantages = [[[1.0, 2.0, 3.0]], [4.0]]
    whiten, _, _ = _weighted_whiten([(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)], 1e-6)
    out = whiten_over_step(advantages)
    np.testing.assert_allclose(out[0][0], [whiten(1.0), whiten(2.0), whiten(3.0)], **TOL)
    assert out[1][0] == pytest.approx(whiten(4.0), abs=1e-12)


# =================================================================== GAE, multi-turn GAE and token rewards


def _gae_closed_form(rewards, values, gamma, lam):
    """A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0."""
    T = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < T else 0.0) - values[t] for t in range(T)]
    return [sum((gamma * lam) ** l * deltas[t + l] for l in range(T - t)) for t in range(T)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.5), (0.99, 0.95), (0.7, 0.0)])
def test_gae_closed_form_reference(gamma, lam):
    """GAE (Schulman et al. 2016, Eq. 16): the closed form sum_l (gamma lam)^l delta_{t+l}, not the
    recursion the code uses; returns (the critic's targets) = A + V (verl compute_gae_advantage_return)."""
    rewards = [0.1, 0.0, -0.3, 0.0, 1.0]
    values = [0.5, 0.2, 0.8, -0.1, 0.4]
    advantages, returns = TOKEN_ESTIMATORS.get("gae")(np.array(rewards), np.array(values), gamma=gamma, lam=lam)
    expected = _gae_closed_form(rewards, values, gamma, lam)
    np.testing.assert_allclose(advantages, expected, **TOL)
    np.testing.assert_allclose(returns, [a + v for a, v in zip(expected, values)], **TOL)


def _verl_multi_turn_gae(rewards, values, mask, gamma, lam):
    """verl core_algos.compute_gae_advantage_return over a full response row with a loss mask: the
    backward loop carries next value and running advantage THROUGH mask-0 positions (observation
    tokens and padding), so a policy token's successor is the next policy token."""
    next_value, running = 0.0, 0.0
    advantages = [0.0] * len(rewards)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        candidate = delta + gamma * lam * running
        if mask[t]:
            next_value, running = values[t], candidate
            advantages[t] = candidate
    return advantages


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_masked_token_estimate_is_multi_turn_gae_over_policy_tokens(gamma, lam):
    """Multi-turn GAE (verl core_algos.compute_gae_advantage_return with response_mask): the
    recursion runs over policy tokens only, V of the next POLICY token follows each one (observation
    tokens are not actions); the code puts advantage 0 and return = value at observation/padding
    tokens (the loss masks them out)."""
    mask = [1, 1, 0, 0, 1, 1, 0, 0]
    values = [0.2, 0.4, -5.0, 3.0, 0.6, 0.1, 9.0, 9.0]  # observation/padding values must not leak in
    full_rewards = [0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # turn reward 0.5, outcome 1.0
    policy_rewards = np.array([r for r, m in zip(full_rewards, mask) if m])
    advantages, returns = masked_token_estimate(gae, policy_rewards, values, mask, gamma=gamma, lam=lam)
    expected = _verl_multi_turn_gae(full_rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(advantages, expected, **TOL)
    np.testing.assert_allclose(returns, [a + v if m else v for a, v, m in zip(expected, values, mask)], **TOL)
    # and by hand, gamma = lam = 1: A_t = (sum of later policy rewards) - V_t at policy tokens
    if gamma == lam == 1.0:
        np.testing.assert_allclose(advantages, [1.5 - 0.2, 1.5 - 0.4, 0, 0, 1.0 - 0.6, 1.0 - 0.1, 0, 0], **TOL)


def test_episode_token_rewards_reference():
    """Multi-turn token rewards (verl multi-turn / OpenRLHF agent rewards placed at turn ends): each
    turn's environment reward on the last policy token of its turn, the rest of the episode's total
    on the last policy token; the output has one entry per policy token."""
    mask = [1, 1, 0, 0, 1, 1, 0, 1, 0, 0]  # turns: tokens 0-1, 4-5, 7
    turn_rewards = [0.5, None, 0.25]
    total = 2.0
    # reference by hand: policy tokens are positions 0, 1, 4, 5, 7 -> indices 0..4
    policy_positions = [t for t, m in enumerate(mask) if m]
    turn_ends = [1, 5, 7]
    expected = [0.0] * len(policy_positions)
    placed = 0.0
    for end, reward in zip(turn_ends, turn_rewards):
        if reward:
            expected[policy_positions.index(end)] += reward
            placed += reward
    expected[-1] += total - placed
    assert expected == [0.0, 0.5, 0.0, 0.0, 1.5]
    np.testing.assert_allclose(episode_token_rewards(total, mask, turn_rewards), expected, **TOL)
    # single turn, right padding: the whole reward on the last policy token
    np.testing.assert_allclose(episode_token_rewards(1.0, [1, 1, 1, 0], [None]), [0.0, 0.0, 1.0], **TOL)


# =================================================================== reward shaping


def _dapo_overlong(length, l_max, l_cache, penalty):
    """DAPO (Yu et al. 2025, Eq. 13) soft overlong punishment, times `penalty`:
    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max;
    -1 if |y| > L_max."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return penalty * ((l_max - l_cache) - length) / l_cache
    return -penalty


def test_overlong_shaping_dapo_reference():
    """DAPO soft overlong punishment (Yu et al. 2025, Eq. 13), including the floor -penalty past
    L_max (a multi-turn episode's policy tokens can exceed the budget the shaping is given)."""
    lengths = [0, 5, 12, 13, 16, 19, 20, 21, 35]
    out = overlong_shaping(np.array(lengths), max_new_tokens=20, buffer=8, penalty=0.5)
    np.testing.assert_allclose(out, [_dapo_overlong(n, 20, 8, 0.5) for n in lengths], **TOL)
    assert out[-1] == pytest.approx(-0.5) and out[-3] == pytest.approx(-0.5)


def test_policy_token_budget_reference():
    """DAPO's L_max / Dr. GRPO's constant normaliser for a multi-turn episode: the policy can write at
    most max_turns x max_new_tokens tokens, and no more than the episode's token budget."""
    assert policy_token_budget(64) == 64
    assert policy_token_budget(64, max_turns=3) == 3 * 64
    assert policy_token_budget(64, max_turns=3, max_episode_tokens=150) == min(3 * 64, 150)
    assert policy_token_budget(64, max_turns=3, max_episode_tokens=500) == min(3 * 64, 500)


def test_sequence_kl_penalty_reference():
    """KL in the reward (verl apply_kl_penalty / OpenRLHF compute_reward with the k1 estimator): per
    response sum over its policy tokens of log pi_behave - log pi_ref (observation tokens excluded)."""
    behavior = [[-0.1, -0.5, -2.0, -3.0, -0.2], [-1.0, -0.3]]
    ref = [[-0.3, -0.4, -0.1, -0.2, -0.9], [-0.5, -0.3]]
    masks = [[1, 1, 0, 0, 1], [1, 1]]
    with_masks = [sum((b - r) for b, r, m in zip(bs, rs, ms) if m) for bs, rs, ms in zip(behavior, ref, masks)]
    without = [sum(b - r for b, r in zip(bs, rs)) for bs, rs in zip(behavior, ref)]
    np.testing.assert_allclose(sequence_kl_penalty(behavior, ref, masks), with_masks, **TOL)
    np.testing.assert_allclose(sequence_kl_penalty(behavior, ref), without, **TOL)
    assert with_masks[0] != pytest.approx(without[0])


# =================================================================== policy losses

# Log-ratios log pi_theta - log pi_old and advantages per token, chosen to hit every branch with the
# clip range [0.8, 1.2] (ratio e^0.5 = 1.65, e^-0.5 = 0.61, e^0.05 = 1.05, ...). Padding / observation
# positions hold ordinary numbers: the per-token loss is unmasked, the mask only enters the stats.
PPO_CASES = {
    "single": dict(
        log_ratio=[[0.5, -0.5, 0.05, -0.5, 0.3, 0.0],
                   [0.5, -0.05, -0.4, 0.25, 0.1, -0.3]],
        adv=[[1.0, -1.0, 2.0, 0.5, -0.7, 1.0],
             [-1.5, 1.0, -0.5, 0.8, 0.0, 1.2]],
        mask=SINGLE_MASK),
    "multi_turn": dict(
        log_ratio=[[0.5, -0.5, 3.0, -3.0, 0.05, -0.3, 0.2, 0.0],
                   [0.4, 2.0, -2.0, -0.35, 0.25, 0.02, 1.5, 0.0]],
        adv=[[1.0, -1.0, 1.0, -1.0, -2.0, 0.5, 1.0, 0.0],
             [-0.5, 1.0, 1.0, 1.5, -1.0, 0.3, -1.0, 0.0]],
        mask=MULTI_MASK),
}


def _ppo_reference(log_ratio, adv, low, high):
    """PPO clipped surrogate per token (Schulman et al. 2017, Eq. 7, as a loss to minimise):
    max(-A r, -A clip(r, 1-low, 1+high)); and its derivative w.r.t. log pi_theta: d r / d logp = r,
    so -A r where the unclipped term is the max (or both are equal: r inside the range), else 0."""
    loss, grad = [], []
    for lr, a in zip(log_ratio, adv):
        r = math.exp(lr)
        unclipped, clipped = -a * r, -a * min(max(r, 1.0 - low), 1.0 + high)
        loss.append(max(unclipped, clipped))
        grad.append(-a * r if unclipped >= clipped else 0.0)
    return loss, grad


@pytest.mark.parametrize("case", sorted(PPO_CASES))
def test_ppo_clip_reference_values_gradients_and_stats(case):
    """PPO-clip (Schulman et al. 2017) with DAPO's decoupled clip range (clip-higher); verl
    core_algos.compute_policy_loss_vanilla (without the dual clip). Values, d/dlogp by autograd vs the
    analytic gradient, and the masked stats (clip fraction, k3 approx_kl of KL(old || new), ratios)."""
    data = PPO_CASES[case]
    low, high = 0.2, 0.28
    old = _t([[-1.0 - 0.1 * t for t in range(len(row))] for row in data["log_ratio"]])
    logprobs = (old + _t(data["log_ratio"])).requires_grad_(True)
    mask = _t(data["mask"])
    loss, stats = POLICY_LOSSES.get("ppo_clip")(logprobs, old, _t(data["adv"]), mask,
                                                clip_eps_low=low, clip_eps_high=high)
    (loss * mask).sum().backward()

    rows = [_ppo_reference(lr, a, low, high) for lr, a in zip(data["log_ratio"], data["adv"])]
    torch.testing.assert_close(loss.detach(), _t([r[0] for r in rows]), **TOL)
    expected_grad = [[g * m for g, m in zip(r[1], ms)] for r, ms in zip(rows, data["mask"])]
    torch.testing.assert_close(logprobs.grad, _t(expected_grad), **TOL)
    assert any(g == 0 for g, m in zip(sum(expected_grad, []), sum(data["mask"], [])) if m), "no clipped token"

    valid = [(lr, a) for lrs, advs, ms in zip(data["log_ratio"], data["adv"], data["mask"])
             for lr, a, m in zip(lrs, advs, ms) if m]
    clipped = [(-a * min(max(math.exp(lr), 1 - low), 1 + high)) > (-a * math.exp(lr)) for lr, a in valid]
    ratios = [math.exp(lr) for lr, _ in valid]
    assert stats["clip_fraction"] == pytest.approx(sum(clipped) / len(valid), abs=1e-12)
    assert stats["approx_kl"] == pytest.approx(sum((r - 1) - math.log(r) for r in ratios) / len(ratios), abs=1e-12)
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-12)
    assert (stats["ratio_max"], stats["ratio_min"]) == (pytest.approx(max(ratios)), pytest.approx(min(ratios)))


def _decoupled_reference(log_prox_ratio, log_behave_weight, adv, low, high, c):
    """Decoupled PPO (Hilton et al. 2022, Eq. of the decoupled objective; AReaL's ppo_actor_loss_fn)
    with verl's dual clip (Ye et al. 2020): r = pi_theta / pi_prox, w = pi_prox / pi_behave (constant),
    surr = max(-A r, -A clip(r)); for A < 0 surr = min(surr, -A c); loss = w surr. Gradient
    w.r.t. log pi_theta: w (-A r) where the unclipped term sets the loss, else 0."""
    loss, grad = [], []
    for lr, lw, a in zip(log_prox_ratio, log_behave_weight, adv):
        r, w = math.exp(lr), math.exp(lw)
        unclipped, clipped = -a * r, -a * min(max(r, 1.0 - low), 1.0 + high)
        surr = max(unclipped, clipped)
        g = -a * r if unclipped >= clipped else 0.0
        if a < 0 and surr > -a * c:
            surr, g = -a * c, 0.0
        loss.append(w * surr)
        grad.append(w * g)
    return loss, grad


@pytest.mark.parametrize("case", sorted(PPO_CASES))
def test_decoupled_ppo_reference_values_gradients_and_dual_clip(case):
    """Decoupled PPO (Hilton et al. 2022; AReaL, proximal policy + behaviour importance weight) with
    dual clip (Ye et al. 2020; verl compute_policy_loss clip_ratio_c): values, gradients (w is
    detached: no gradient through pi_prox) and the dual-clip fraction over masked tokens."""
    data = PPO_CASES[case]
    low, high, c = 0.2, 0.2, 3.0
    # behaviour weights log(pi_prox / pi_behave) per token: mixed staleness
    log_w = [[0.1 * ((t % 3) - 1) for t in range(len(row))] for row in data["log_ratio"]]
    log_ratio = [row[:] for row in data["log_ratio"]]
    log_ratio[0][1] = 1.3  # ratio 3.67 > c with A = -1: the dual clip must bind on a valid token
    behavior = _t([[-2.0 + 0.05 * t for t in range(len(row))] for row in log_ratio])
    proximal = behavior + _t(log_w)
    logprobs = (proximal + _t(log_ratio)).requires_grad_(True)
    mask = _t(data["mask"])
    loss, stats = POLICY_LOSSES.get("decoupled_ppo")(logprobs, behavior, _t(data["adv"]), mask,
                                                     proximal_logprobs=proximal, clip_eps_low=low,
                                                     clip_eps_high=high, clip_ratio_c=c)
    (loss * mask).sum().backward()
    rows = [_decoupled_reference(lr, lw, a, low, high, c) for lr, lw, a in zip(log_ratio, log_w, data["adv"])]
    torch.testing.assert_close(loss.detach(), _t([r[0] for r in rows]), **TOL)
    torch.testing.assert_close(logprobs.grad, _t([[g * m for g, m in zip(r[1], ms)]
                                                  for r, ms in zip(rows, data["mask"])]), **TOL)
    valid = [(lr, a) for lrs, advs, ms in zip(log_ratio, data["adv"], data["mask"]) for lr, a, m in zip(lrs, advs, ms) if m]
    dual = [a < 0 and max(-a * math.exp(lr), -a * min(max(math.exp(lr), 1 - low), 1 + high)) > -a * c
            for lr, a in valid]
    assert any(dual)
    assert stats["dual_clip_fraction"] == pytest.approx(sum(dual) / len(valid), abs=1e-12)


GSPO_CASES = {
    "single": dict(
        log_ratio=[[0.3, 0.4, 0.1, 0.2, 5.0, 5.0],
                   [-0.02, 0.01, -0.03, 0.0, 0.02, -0.01]],
        adv=[[1.0] * 6, [-0.8] * 6],
        mask=SINGLE_MASK),
    # the observation tokens hold large log-ratios: counted, they would change the mean a lot
    "multi_turn": dict(
        log_ratio=[[0.05, -0.1, 4.0, 4.0, 0.02, 0.03, 4.0, 4.0],
                   [0.3, -4.0, -4.0, 0.25, 0.4, 0.2, 0.35, 3.0]],
        adv=[[-1.0] * 8, [0.7] * 8],
        mask=MULTI_MASK),
}


@pytest.mark.parametrize("case", sorted(GSPO_CASES))
def test_gspo_reference_values_and_gradients(case):
    """GSPO (Zheng et al. 2025, Eqs. 5-7): s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) =
    exp(mean over the response's policy tokens of log-ratios), A_i the response's advantage,
    loss_i = max(-A_i s_i, -A_i clip(s_i, 1-low, 1+high)) on every token. Gradient of
    1/G sum_i loss_i: d s_i / d logp_it = s_i / |y_i| at policy tokens, 0 at observation/padding."""
    data = GSPO_CASES[case]
    low, high = 0.2, 0.2
    old = _t([[-0.5 - 0.2 * t for t in range(len(row))] for row in data["log_ratio"]])
    logprobs = (old + _t(data["log_ratio"])).requires_grad_(True)
    mask = _t(data["mask"])
    loss, stats = POLICY_LOSSES.get("gspo")(logprobs, old, _t(data["adv"]), mask, clip_eps_low=low, clip_eps_high=high)
    # 1/G sum_i loss_i, written out (each row's loss is the same on all its tokens)
    lengths = mask.sum(dim=-1)
    ((loss * mask).sum(dim=-1) / lengths).mean().backward()

    expected_loss, expected_grad, seq_ratios, clipped = [], [], [], []
    for lrs, advs, ms in zip(data["log_ratio"], data["adv"], data["mask"]):
        n = sum(ms)
        s = math.exp(sum(lr for lr, m in zip(lrs, ms) if m) / n)
        a = sum(x for x, m in zip(advs, ms) if m) / n
        unc, cl = -a * s, -a * min(max(s, 1 - low), 1 + high)
        expected_loss.append([max(unc, cl)] * len(lrs))
        g = (-a * s / n if unc >= cl else 0.0) / len(data["mask"])
        expected_grad.append([g * m for m in ms])
        seq_ratios += [s] * n
        clipped += [cl > unc] * n
    assert any(clipped) and not all(clipped)  # a clipped and an unclipped response
    torch.testing.assert_close(loss.detach(), _t(expected_loss), **TOL)
    torch.testing.assert_close(logprobs.grad, _t(expected_grad), **TOL)
    assert stats["ratio_mean"] == pytest.approx(sum(seq_ratios) / len(seq_ratios), abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)


# =================================================================== loss aggregation

# 6 responses: single-turn, multi-turn, and one whose every token is an observation (trains nothing).
AGG_MASK = [[1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1],
            [1, 0, 0, 1, 1, 1, 1, 0],
            [1, 0, 0, 0, 0, 0, 0, 0]]
AGG_LOSS = [[0.1 * (b + 1) * (t - 3) + 0.05 * b * b for t in range(8)] for b in range(6)]
MAX_TOKENS = 10


def _token_mean_ref(loss, mask, denominator=None):
    total = sum(l * m for row, ms in zip(loss, mask) for l, m in zip(row, ms))
    return total / (denominator if denominator is not None else sum(sum(ms) for ms in mask))


def _seq_mean_token_mean_ref(loss, mask):
    means = [sum(l * m for l, m in zip(row, ms)) / sum(ms) for row, ms in zip(loss, mask) if sum(ms)]
    return sum(means) / len(means) if means else 0.0


def _seq_mean_token_sum_norm_ref(loss, mask, max_tokens, num_sequences=None):
    total = sum(l * m for row, ms in zip(loss, mask) for l, m in zip(row, ms))
    return total / ((num_sequences if num_sequences is not None else len(loss)) * max_tokens)


def test_token_mean_reference():
    """Token-level mean (DAPO Eq. 12; verl agg_loss "token-mean"): sum(l m) / sum(m), the masked
    observation tokens excluded; `num_tokens` replaces the denominator."""
    fn = LOSS_AGGREGATIONS.get("token_mean")
    assert float(fn(_t(AGG_LOSS), _t(AGG_MASK))) == pytest.approx(_token_mean_ref(AGG_LOSS, AGG_MASK), abs=1e-12)
    assert float(fn(_t(AGG_LOSS), _t(AGG_MASK), num_tokens=50.0)) == pytest.approx(
        _token_mean_ref(AGG_LOSS, AGG_MASK, 50.0), abs=1e-12)


def test_seq_mean_token_mean_reference():
    """Original GRPO aggregation (DeepSeekMath Eq. 3: 1/G sum_i 1/|o_i| sum_t; verl agg_loss
    "seq-mean-token-mean"): mean over responses of each one's masked token mean; a response with no
    trained token is left out of the mean (not counted as a zero)."""
    fn = LOSS_AGGREGATIONS.get("seq_mean_token_mean")
    assert float(fn(_t(AGG_LOSS), _t(AGG_MASK))) == pytest.approx(_seq_mean_token_mean_ref(AGG_LOSS, AGG_MASK), abs=1e-12)


def test_seq_mean_token_sum_norm_reference():
    """Dr. GRPO aggregation (Liu et al. 2025, Eq. of the unbiased objective; "seq-mean-token-sum-norm"):
    sum(l m) / (B * max_tokens), a constant budget instead of each response's length; `num_sequences`
    replaces B."""
    fn = LOSS_AGGREGATIONS.get("seq_mean_token_sum_norm")
    assert float(fn(_t(AGG_LOSS), _t(AGG_MASK), max_tokens=MAX_TOKENS)) == pytest.approx(
        _seq_mean_token_sum_norm_ref(AGG_LOSS, AGG_MASK, MAX_TOKENS), abs=1e-12)
    assert float(fn(_t(AGG_LOSS), _t(AGG_MASK), max_tokens=MAX_TOKENS, num_sequences=4)) == pytest.approx(
        _seq_mean_token_sum_norm_ref(AGG_LOSS, AGG_MASK, MAX_TOKENS, 4), abs=1e-12)


def _split_aggregate(name, loss, world, shards):
    """What DeepSpeed optimises over `world` ranks with gradient accumulation: each rank sums its
    micro-batches' losses, the ranks' gradients are averaged (1/world). `shards`: per rank, the row
    indices of each micro-batch. Global normalisers divided by world, as the train worker passes them;
    seq_mean_token_mean weighted by share = micro-batch valid responses * world / global valid ones."""
    fn = LOSS_AGGREGATIONS.get(name)
    mask = _t(AGG_MASK)
    global_tokens = float(mask.sum())
    global_sequences = len(AGG_MASK)
    global_valid = int((mask.sum(dim=-1) > 0).sum())
    total = 0.0
    for rank in shards:
        for rows in rank:
            part_loss, part_mask = loss[rows], mask[rows]
            if name == "token_mean":
                value = fn(part_loss, part_mask, num_tokens=global_tokens / world)
            elif name == "seq_mean_token_sum_norm":
                value = fn(part_loss, part_mask, max_tokens=MAX_TOKENS, num_sequences=global_sequences / world)
            else:
                valid = int((part_mask.sum(dim=-1) > 0).sum())
                value = fn(part_loss, part_mask) * (valid * world / global_valid)
            total = total + value
    return total / world


SPLITS = {
    "two_ranks": [[[0, 1, 2]], [[3, 4, 5]]],
    "two_ranks_micro_batches": [[[0], [1, 2]], [[3, 5], [4]]],
    "uneven_ranks": [[[2, 0]], [[1, 3, 4, 5]]],
}


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_split_over_ranks_and_micro_batches_equals_whole_batch(name, split):
    """Data-parallel equivalence (verl's global-token normalisation, dp_actor loss scaling; OpenRLHF's
    packed-sample token mean): split over two ranks (and micro-batches) with the global normalisers,
    the ranks' average equals the whole batch's aggregate computed by the reference formula, in value
    and in gradient w.r.t. the per-token loss."""
    reference = {"token_mean": lambda l: _token_mean_ref(l, AGG_MASK),
                 "seq_mean_token_mean": lambda l: _seq_mean_token_mean_ref(l, AGG_MASK),
                 "seq_mean_token_sum_norm": lambda l: _seq_mean_token_sum_norm_ref(l, AGG_MASK, MAX_TOKENS)}[name]
    loss = _t(AGG_LOSS).requires_grad_(True)
    combined = _split_aggregate(name, loss, 2, SPLITS[split])
    assert float(combined.detach()) == pytest.approx(reference(AGG_LOSS), abs=1e-12)
    combined.backward()
    # reference gradient: the aggregate is linear in the per-token loss, d/dl[b][t] by finite pattern
    expected = []
    for b in range(len(AGG_LOSS)):
        row = []
        for t in range(len(AGG_LOSS[0])):
            unit = [[1.0 if (i, j) == (b, t) else 0.0 for j in range(len(AGG_LOSS[0]))] for i in range(len(AGG_LOSS))]
            row.append(reference(unit))
        expected.append(row)
    torch.testing.assert_close(loss.grad, _t(expected), **TOL)


# =================================================================== KL estimators

KL_LOGP = [[-0.1, -2.3, -0.7, -1.2, -0.05, -3.0],
           [-0.4, -0.9, -5.0, -0.2, -1.7, -0.6]]
KL_REF = [[-0.3, -1.1, -0.7, -2.5, -0.2, -0.8],
          [-0.6, -0.4, -1.0, -0.9, -1.1, -3.3]]


def test_kl_estimators_reference_values():
    """Schulman, "Approximating KL divergence" (2020), with r = pi_ref / pi_theta on tokens from
    pi_theta: k1 = -log r = logp - ref, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (verl kl_penalty
    "kl", "mse", "low_var_kl"; OpenRLHF compute_approx_kl)."""
    logp, ref = _t(KL_LOGP), _t(KL_REF)
    k1 = [[p - q for p, q in zip(ps, qs)] for ps, qs in zip(KL_LOGP, KL_REF)]
    k2 = [[0.5 * (p - q) ** 2 for p, q in zip(ps, qs)] for ps, qs in zip(KL_LOGP, KL_REF)]
    k3 = [[math.exp(q - p) - 1.0 - (q - p) for p, q in zip(ps, qs)] for ps, qs in zip(KL_LOGP, KL_REF)]
    torch.testing.assert_close(KL_ESTIMATORS.get("k1")(logp, ref), _t(k1), **TOL)
    torch.testing.assert_close(KL_ESTIMATORS.get("k2")(logp, ref), _t(k2), **TOL)
    torch.testing.assert_close(KL_ESTIMATORS.get("k3")(logp, ref), _t(k3), **TOL)
    assert min(min(row) for row in k3) >= 0.0


def test_kl_k3_and_k1_are_unbiased_for_kl_on_samples_from_the_policy():
    """Schulman, "Approximating KL divergence": on x ~ p, E[k1] = E[k3] = KL(p || q) = sum p log(p/q)
    (k3 with lower variance). Two categorical distributions, 20000 seeded samples."""
    p = [0.5, 0.3, 0.15, 0.05]
    q = [0.2, 0.3, 0.3, 0.2]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    generator = torch.Generator().manual_seed(1234)
    samples = torch.multinomial(torch.tensor(p, dtype=torch.float64), 20000, replacement=True, generator=generator)
    logp = torch.log(torch.tensor(p, dtype=torch.float64))[samples].unsqueeze(0)  # [1, N]
    logq = torch.log(torch.tensor(q, dtype=torch.float64))[samples].unsqueeze(0)  # [1, N]
    k3 = KL_ESTIMATORS.get("k3")(logp, logq)
    k1 = KL_ESTIMATORS.get("k1")(logp, logq)
    # standard errors here are ~0.0024 (k3) and ~0.005 (k1): 0.025 is > 4 of them
    assert float(k3.mean()) == pytest.approx(kl, abs=0.025)
    assert float(k1.mean()) == pytest.approx(kl, abs=0.025)
    assert float(k3.std()) < float(k1.std())  # the point of k3


# =================================================================== value loss


def test_clipped_value_loss_reference():
    """PPO clipped value loss with the 1/2 of verl core_algos.compute_value_loss and OpenRLHF
    ValueLoss: 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), times the mask
    (multi-turn: observation tokens carry no loss); gradient 1/2 * 2 (V - R) = V - R where the
    unclipped term is larger, 0 where the clipped one is (V outside the clip range); the share of
    valid tokens with the clipped term larger."""
    eps = 0.2
    values = [[0.5, -0.1, 0.7, 0.3, 0.9, 0.05, 0.4, 0.0],
              [1.2, 0.1, 0.6, -0.5, 0.45, 0.3, 0.0, 0.0]]
    old = [[0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0],
           [1.0, 0.5, 0.0, 0.0, 0.2, 0.35, 0.0, 0.0]]
    returns = [[1.0, 1.0, 0.0, 1.0, 0.1, -1.0, 2.0, 0.0],
               [0.0, 0.2, 1.5, 0.5, 0.4, 1.0, 0.0, 0.0]]
    mask = MULTI_MASK
    v = _t(values).requires_grad_(True)
    loss, stats = VALUE_LOSSES.get("clipped")(v, _t(old), _t(returns), _t(mask), value_clip=eps)
    loss.sum().backward()
    expected, grad, active = [], [], []
    for vs, os_, rs, ms in zip(values, old, returns, mask):
        row_loss, row_grad = [], []
        for vt, ot, rt, m in zip(vs, os_, rs, ms):
            clipped_v = ot + min(max(vt - ot, -eps), eps)
            unclipped, clipped = (vt - rt) ** 2, (clipped_v - rt) ** 2
            row_loss.append(0.5 * max(unclipped, clipped) * m)
            row_grad.append((vt - rt) * m if unclipped >= clipped else 0.0)
            if m:
                active.append(clipped > unclipped)
        expected.append(row_loss)
        grad.append(row_grad)
    torch.testing.assert_close(loss.detach(), _t(expected), **TOL)
    torch.testing.assert_close(v.grad, _t(grad), **TOL)
    assert 0 < sum(active) < len(active)
    assert stats["value_clip_fraction"] == pytest.approx(sum(active) / len(active), abs=1e-12)


# =================================================================== mismatch correction (TIS, MIS)

# The brief's example: one response rho = pi_prox / pi_behave = [4, 0.5, 1] + one padded token.
RHO_LOG = _t([[math.log(4.0), math.log(0.5), 0.0, 0.0]])
RHO_MASK = _t([[1.0, 1.0, 1.0, 0.0]])

# A multi-turn batch built the pipeline's way (behavior_log_ratio: 0 at mask-0 positions). The
# observation tokens' log-probs differ wildly (the engine never sampled them): they must not count.
CORR_MASK = [[1, 1, 0, 0, 1, 1, 0, 0],
             [1, 0, 0, 1, 1, 1, 1, 0],
             [1, 1, 1, 0, 0, 0, 0, 0]]
CORR_BEHAVIOR = [[-1.0, -0.5, -9.0, -9.0, -2.0, -0.3, -7.0, -7.0],
                 [-0.2, -8.0, -8.0, -0.6, -1.1, -0.4, -0.9, -6.0],
                 [-0.7, -0.8, -0.9, -5.0, -5.0, -5.0, -5.0, -5.0]]
CORR_LOG_RHO = [[0.6, 0.3, 0.0, 0.0, 0.9, 0.4, 0.0, 0.0],
                [-0.3, 0.0, 0.0, 0.05, -0.9, 0.2, 0.1, 0.0],
                [0.02, -0.01, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0]]
CORR_OBS_NOISE = [[0.0, 0.0, 3.0, -2.0, 0.0, 0.0, 1.5, 4.0],
                  [0.0, -3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 5.0],
                  [0.0, 0.0, 0.0, 2.0, -2.0, 3.0, 1.0, 1.0]]


def _corr_batch():
    behavior = _t(CORR_BEHAVIOR)
    proximal = behavior + _t(CORR_LOG_RHO) + _t(CORR_OBS_NOISE)  # noise only at mask-0 positions
    mask = _t(CORR_MASK)
    return behavior_log_ratio(proximal, behavior, mask), mask


def _rho(row_log, row_mask):
    return [math.exp(lr) for lr, m in zip(row_log, row_mask) if m]


def test_tis_token_reference():
    """Token-level TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"; verl rollout correction, token level): the behaviour weight of each token becomes
    min(rho_t, C). The loss carries rho_t, so the factor is min(rho_t, C) / rho_t and the effective
    weight rho_t * factor = min(rho_t, C); truncated where rho_t > C."""
    settings = CorrectionSettings(tis="token", tis_cap=1.5)
    factor, truncated, masked = correction_factors(RHO_LOG, RHO_MASK, settings)
    rho = [4.0, 0.5, 1.0]
    torch.testing.assert_close(factor[0, :3] * _t(rho), _t([1.5, 0.5, 1.0]), **TOL)
    torch.testing.assert_close(factor[0, :3], _t([min(r, 1.5) / r for r in rho]), **TOL)
    assert truncated.tolist() == [[True, False, False, False]] and not masked.any()
    torch.testing.assert_close(TIS_MODES.get("token")(RHO_LOG, RHO_MASK), RHO_LOG, **TOL)

    log_rho, mask = _corr_batch()
    cap = 1.3
    factor, truncated, _ = correction_factors(log_rho, mask, CorrectionSettings(tis="token", tis_cap=cap))
    for b, (row, ms) in enumerate(zip(CORR_LOG_RHO, CORR_MASK)):
        for t, (lr, m) in enumerate(zip(row, ms)):
            if m:
                rho_t = math.exp(lr)
                assert float(factor[b, t]) * rho_t == pytest.approx(min(rho_t, cap), abs=1e-12)
                assert bool(truncated[b, t]) == (rho_t > cap)
            else:
                assert not truncated[b, t]


def test_tis_sequence_reference():
    """Sequence-level TIS (verl rollout correction, sequence level: the response's weight
    prod_t rho_t = exp(sum of log rho over its policy tokens), truncated at C, on each of its
    tokens). The loss carries rho_t per token, so factor = min(prod rho, C) / rho_t and the effective
    weight is min(prod rho, C) on every token; truncated (all of the response's policy tokens)
    where prod rho > C. The brief's example: rho [4, 0.5, 1], C 1.5 -> effective 1.5 everywhere,
    factor [0.375, 3, 1.5]."""
    settings = CorrectionSettings(tis="sequence", tis_cap=1.5)
    factor, truncated, _ = correction_factors(RHO_LOG, RHO_MASK, settings)
    torch.testing.assert_close(factor[0, :3], _t([0.375, 3.0, 1.5]), **TOL)
    torch.testing.assert_close(factor[0, :3] * _t([4.0, 0.5, 1.0]), _t([1.5, 1.5, 1.5]), **TOL)
    assert truncated.tolist() == [[True, True, True, False]]
    torch.testing.assert_close(TIS_MODES.get("sequence")(RHO_LOG, RHO_MASK)[0, :3], _t([math.log(2.0)] * 3), **TOL)
    # the same through tis_factor directly
    torch.testing.assert_close(tis_factor(RHO_LOG, _t([[math.log(2.0)] * 4]), 1.5)[0, :3], _t([0.375, 3.0, 1.5]), **TOL)

    log_rho, mask = _corr_batch()
    cap = 1.5
    factor, truncated, _ = correction_factors(log_rho, mask, CorrectionSettings(tis="sequence", tis_cap=cap))
    prods = []
    for b, (row, ms) in enumerate(zip(CORR_LOG_RHO, CORR_MASK)):
        prod = math.prod(_rho(row, ms))  # policy tokens only
        prods.append(prod)
        for t, (lr, m) in enumerate(zip(row, ms)):
            if m:
                assert float(factor[b, t]) * math.exp(lr) == pytest.approx(min(prod, cap), abs=1e-12)
            assert bool(truncated[b, t]) == bool(m and prod > cap)
    assert prods[0] > cap > prods[2]  # one response truncated, one not


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_tis_gradient_through_ppo_clip_and_decoupled_ppo(mode):
    """The corrected gradient (verl rollout correction; Yao et al. 2025): at theta = pi_prox the
    policy-gradient of a token is -A * (capped behaviour weight) = -A min(w, C), w = rho_t (token)
    or prod rho (sequence). ppo_clip carries rho_t in its ratio pi_theta / pi_behave (clip range
    wide enough that no token is clipped), decoupled_ppo as its weight pi_prox / pi_behave."""
    log_rho, mask = _corr_batch()
    cap = 1.4
    factor, _, _ = correction_factors(log_rho, mask, CorrectionSettings(tis=mode, tis_cap=cap))
    behavior = _t(CORR_BEHAVIOR)
    proximal = behavior + log_rho  # at observation tokens pi_prox = pi_behave here: they are masked anyway
    adv = _t([[1.0, -0.5, 0.0, 0.0, 2.0, -1.0, 0.0, 0.0],
              [-1.5, 0.0, 0.0, 0.7, 1.0, -0.3, 0.4, 0.0],
              [0.8, -0.8, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    expected = []
    for b, (row, ms) in enumerate(zip(CORR_LOG_RHO, CORR_MASK)):
        prod = math.prod(_rho(row, ms))
        expected.append([-float(adv[b, t]) * min(math.exp(lr) if mode == "token" else prod, cap) * m
                         for t, (lr, m) in enumerate(zip(row, ms))])
    for name, options in (("ppo_clip", dict(clip_eps_low=0.99, clip_eps_high=100.0)),
                          ("decoupled_ppo", dict(proximal_logprobs=proximal, clip_eps_low=0.2, clip_eps_high=0.2))):
        logprobs = proximal.clone().requires_grad_(True)
        loss, _ = POLICY_LOSSES.get(name)(logprobs, behavior, adv, mask, **options)
        (loss * factor * mask).sum().backward()
        torch.testing.assert_close(logprobs.grad, _t(expected), **TOL, msg=name)


def test_mis_modes_reference():
    """Importance-sampling masking (verl rollout correction "mask" modes; IcePop-style token masking):
    keep (1) where the ratio is in [low, high], else 0: token rho_t, sequence prod_t rho_t, geometric
    exp(mean of log rho over the response's policy tokens); `masked` marks the dropped policy tokens."""
    log_rho, mask = _corr_batch()
    low, high = 0.7, 1.6
    references = {
        "token": lambda row, ms: [math.exp(lr) for lr in row],
        "sequence": lambda row, ms: [math.prod(_rho(row, ms))] * len(row),
        "geometric": lambda row, ms: [math.exp(sum(lr for lr, m in zip(row, ms) if m) / sum(ms))] * len(row),
    }
    for mode, ratio_of in references.items():
        keep = MIS_MODES.get(mode)(log_rho, mask, low=low, high=high)
        factor, truncated, masked = correction_factors(
            log_rho, mask, CorrectionSettings(mis=mode, mis_low=low, mis_high=high))
        for b, (row, ms) in enumerate(zip(CORR_LOG_RHO, CORR_MASK)):
            ratios = ratio_of(row, ms)
            for t, m in enumerate(ms):
                if not m:
                    assert not masked[b, t]
                    continue
                inside = low <= ratios[t] <= high
                assert float(keep[b, t]) == float(inside), (mode, b, t)
                assert float(factor[b, t]) == float(inside), (mode, b, t)
                assert bool(masked[b, t]) == (not inside), (mode, b, t)
        assert not truncated.any()
        valid_keep = [float(keep[b, t]) for b in range(len(CORR_MASK)) for t in range(8) if CORR_MASK[b][t]]
        assert 0 < sum(valid_keep) < len(valid_keep), mode  # both outcomes exercised


def test_tis_and_mis_combine_multiplicatively():
    """verl rollout correction applies the truncated weight and the rejection mask together:
    factor = (min(w, C) / rho_t) * keep, per token."""
    log_rho, mask = _corr_batch()
    settings = CorrectionSettings(tis="sequence", tis_cap=1.5, mis="token", mis_low=0.7, mis_high=1.6)
    factor, truncated, masked = correction_factors(log_rho, mask, settings)
    for b, (row, ms) in enumerate(zip(CORR_LOG_RHO, CORR_MASK)):
        prod = math.prod(_rho(row, ms))
        for t, (lr, m) in enumerate(zip(row, ms)):
            if not m:
                continue
            rho_t = math.exp(lr)
            keep = 1.0 if 0.7 <= rho_t <= 1.6 else 0.0
            assert float(factor[b, t]) == pytest.approx(min(prod, 1.5) / rho_t * keep, abs=1e-12)
            assert bool(truncated[b, t]) == (prod > 1.5)
            assert bool(masked[b, t]) == (keep == 0.0)
