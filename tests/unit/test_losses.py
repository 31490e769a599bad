"""Policy loss, aggregations and token helpers, against hand-computed values."""

import math

import pytest
import torch

from operators.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    decoupled_ppo,
    entropy_from_logits,
    gspo,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_mean,
    ppo_clip,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_logprobs,
    token_mean,
)

TOL = dict(atol=1e-6, rtol=1e-6)


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------ ppo_clip

# One sequence, 5 valid tokens + 1 padded token. old_logprobs = 0, so
# ratio = exp(logprobs) = the listed ratios. Clip range [0.8, 1.2].
#   tok  A   ratio  -A*ratio  -A*clamp(ratio)   max    clipping active?
#   0   +1   1.5    -1.5      -1.2             -1.2   yes (high side, A>0)
#   1   -1   0.5     0.5       0.8              0.8   yes (low side, A<0)
#   2   +1   0.5    -0.5      -0.8             -0.5   no  (pessimistic keeps unclipped)
#   3   -1   1.5     1.5       1.2              1.5   no
#   4   +2   1.1    -2.2      -2.2             -2.2   no  (inside range)
#   5   +1   3.0    (padded: ignored by stats)
RATIOS = [1.5, 0.5, 0.5, 1.5, 1.1, 3.0]
ADVANTAGES = [[1.0, -1.0, 1.0, -1.0, 2.0, 1.0]]
MASK = [[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def _ppo_inputs():
    logprobs = _t([[math.log(r) for r in RATIOS]]).requires_grad_(True)
    return logprobs, torch.zeros(1, 6, dtype=torch.float64), _t(ADVANTAGES), _t(MASK)


def test_ppo_clip_per_token_loss_and_stats():
    logprobs, old, adv, mask = _ppo_inputs()
    loss, stats = ppo_clip(logprobs, old, adv, mask)

    # padded token 5: A=+1, ratio 3.0 -> max(-3.0, -1.2) = -1.2 (left for the aggregation to mask)
    torch.testing.assert_close(loss, _t([[-1.2, 0.8, -0.5, 1.5, -2.2, -1.2]]), **TOL)
    # clipping changed tokens 0 and 1 out of 5 valid -> 0.4 (padded token 5 would also be clipped)
    assert stats["clip_fraction"] == pytest.approx(0.4, abs=1e-9)
    # (1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5 = 5.1 / 5 = 1.02; the padded 3.0 is excluded
    assert stats["ratio_mean"] == pytest.approx(1.02, abs=1e-9)
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-9)
    assert stats["ratio_min"] == pytest.approx(0.5, abs=1e-9)
    # k3 = (r - 1) - ln r:
    #   r=1.5: 0.5 - 0.4054651081 = 0.0945348919
    #   r=0.5: -0.5 + 0.6931471806 = 0.1931471806
    #   r=1.1: 0.1 - 0.0953101798 = 0.0046898202
    #   mean = (2*0.0945348919 + 2*0.1931471806 + 0.0046898202) / 5 = 0.5800539652 / 5
    assert stats["approx_kl"] == pytest.approx(0.1160107930, abs=1e-9)
    assert all(type(v) is float for v in stats.values())


def test_ppo_clip_gradient_is_zero_on_clipped_tokens():
    logprobs, old, adv, mask = _ppo_inputs()
    loss, _ = ppo_clip(logprobs, old, adv, mask)
    (loss * mask).sum().backward()
    # d(-A * ratio)/d logprob = -A * ratio on unclipped tokens; 0 where the clamp is active.
    #   tok2: -(+1)*0.5 = -0.5   tok3: -(-1)*1.5 = 1.5   tok4: -(2)*1.1 = -2.2
    torch.testing.assert_close(logprobs.grad, _t([[0.0, 0.0, -0.5, 1.5, -2.2, 0.0]]), **TOL)


def test_ppo_clip_asymmetric_clip_higher():
    # clip range [1-0.2, 1+0.28] = [0.8, 1.28], all A = +1:
    #   ratio 1.25: inside -> -1.25 (would be clipped to -1.2 with symmetric 0.2)
    #   ratio 1.50: clipped high -> -1.28
    #   ratio 0.70: A>0 low side, pessimistic max(-0.7, -0.8) = -0.7, not clipped
    logprobs = _t([[math.log(1.25), math.log(1.5), math.log(0.7)]])
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.ones(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ppo_clip(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss, _t([[-1.25, -1.28, -0.7]]), **TOL)
    assert stats["clip_fraction"] == pytest.approx(1 / 3, abs=1e-9)


def test_ppo_clip_empty_mask_stats_are_neutral():
    logprobs, old, adv, _ = _ppo_inputs()
    _, stats = ppo_clip(logprobs, old, adv, torch.zeros(1, 6))
    assert stats == {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "ratio_min": 1.0}


def test_ppo_clip_huge_log_ratio_stays_finite():
    # log-ratio 0 - (-1000) = 1000 would overflow exp to inf; clamped to 20: ratio e^20, clipped to 1.2
    # for A = +1 -> loss max(-e^20, -1.2) = -1.2; for A = -1 -> max(e^20, 1.2) = e^20 = 4.85165195e8, finite.
    logprobs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = _t([[-1000.0, -1000.0]])
    loss, stats = ppo_clip(logprobs, old, _t([[1.0, -1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(loss.detach(), _t([[-1.2, math.exp(20.0)]]), **TOL)
    (loss.sum()).backward()
    assert torch.isfinite(logprobs.grad).all() and all(math.isfinite(v) for v in stats.values())


# ------------------------------------------------------------- decoupled_ppo

# One sequence, 5 valid tokens + 1 padded. proximal = 0, so ratio pi_theta/pi_prox = exp(logprobs);
# behaviour = -ln w, so the importance weight pi_prox/pi_behave = w. Clip [0.8, 1.2], dual clip c = 3.
#   tok  A   ratio  w    -A*r   -A*clamp(r)  max    dual (A<0: min with -A*c = 3)  loss = w * surr
#   0   +1   1.5   2.0  -1.5   -1.2         -1.2   -                               -2.4  (clipped)
#   1   -1   0.5   0.5   0.5    0.8          0.8   0.8                              0.4  (clipped)
#   2   -1   4.0   1.0   4.0    1.2          4.0   min(4.0, 3.0) = 3.0              3.0  (dual clip)
#   3   -1   2.0   1.0   2.0    1.2          2.0   2.0                              2.0
#   4   +2   1.1   1.0  -2.2   -2.2         -2.2   -                               -2.2
#   5   padded
D_RATIOS = [1.5, 0.5, 4.0, 2.0, 1.1, 1.0]
D_WEIGHTS = [2.0, 0.5, 1.0, 1.0, 1.0, 1.0]
D_ADV = [[1.0, -1.0, -1.0, -1.0, 2.0, 0.0]]


def _decoupled_inputs():
    logprobs = _t([[math.log(r) for r in D_RATIOS]]).requires_grad_(True)
    behavior = _t([[-math.log(w) for w in D_WEIGHTS]])
    return logprobs, behavior, _t(D_ADV), _t(MASK), torch.zeros(1, 6, dtype=torch.float64)


def test_decoupled_ppo_centres_clip_on_proximal_and_weights_by_behaviour_ratio():
    logprobs, behavior, adv, mask, proximal = _decoupled_inputs()
    loss, stats = decoupled_ppo(logprobs, behavior, adv, mask, proximal_logprobs=proximal, clip_ratio_c=3.0)
    torch.testing.assert_close(loss[:, :5], _t([[-2.4, 0.4, 3.0, 2.0, -2.2]]), **TOL)
    assert stats["clip_fraction"] == pytest.approx(2 / 5, abs=1e-9)  # tokens 0 and 1
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 5, abs=1e-9)  # token 2
    # ratio pi_theta / pi_prox: (1.5 + 0.5 + 4.0 + 2.0 + 1.1) / 5 = 1.82, max 4.0, min 0.5
    assert stats["ratio_mean"] == pytest.approx(1.82, abs=1e-9)
    assert (stats["ratio_max"], stats["ratio_min"]) == (pytest.approx(4.0), pytest.approx(0.5))

    (loss * mask).sum().backward()
    # d(w * -A * r)/d logprob = w * -A * r where neither clip is active; 0 on tokens 0, 1 (clip), 2 (dual clip)
    #   tok3: 1 * 1 * 2.0 = 2.0   tok4: 1 * -2 * 1.1 = -2.2
    torch.testing.assert_close(logprobs.grad, _t([[0.0, 0.0, 0.0, 2.0, -2.2, 0.0]]), **TOL)


def test_decoupled_ppo_one_update_has_the_naive_gradient_where_ppo_clip_does_not_clip():
    # With one update pi_prox = pi_theta (detached): ratio 1 (never clipped), weight pi_theta/pi_behave,
    # so the gradient -A * pi_theta/pi_behave equals ppo_clip's on its unclipped tokens (2, 3, 4 of
    # the ppo_clip table above), and is kept (not zeroed) on the tokens ppo_clip clips (0, 1).
    logprobs, old, adv, mask = _ppo_inputs()
    naive_loss, _ = ppo_clip(logprobs, old, adv, mask)
    (naive_loss * mask).sum().backward()
    naive_grad = logprobs.grad.clone()
    logprobs.grad = None
    loss, stats = decoupled_ppo(logprobs, old, adv, mask, proximal_logprobs=logprobs.detach())
    (loss * mask).sum().backward()
    torch.testing.assert_close(logprobs.grad[:, 2:5], naive_grad[:, 2:5], **TOL)
    # tokens 0, 1: -A * ratio = -(+1) * 1.5 = -1.5 and -(-1) * 0.5 = 0.5
    torch.testing.assert_close(logprobs.grad[:, :2], _t([[-1.5, 0.5]]), **TOL)
    assert stats["clip_fraction"] == 0.0 and stats["ratio_max"] == pytest.approx(1.0)


# ----------------------------------------------------------------------- gspo

# Two responses; padded positions hold 5.0 log-ratios to prove they are ignored.
#   seq 0: log-ratios [ln 2, 0], A = +1:  s = exp(ln2 / 2) = sqrt 2 = 1.4142135624
#          clip [0.8, 1.2]: max(-1.41421, -1.2) = -1.2 (clipped)
#   seq 1: log-ratios [ln .9, ln .9, ln .9], A per token [-0.5, -1.5, -1.0] -> mean -1.0: s = 0.9,
#          max(0.9, 0.9) = 0.9 (inside the range, not clipped)
def test_gspo_sequence_ratio_clip_and_gradient():
    lr9 = math.log(0.9)
    logprobs = _t([[math.log(2.0), 0.0, 5.0, 5.0], [lr9, lr9, lr9, 5.0]]).requires_grad_(True)
    old = torch.zeros(2, 4, dtype=torch.float64)
    adv = _t([[1.0, 1.0, 1.0, 1.0], [-0.5, -1.5, -1.0, 0.0]])
    mask = _t([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    loss, stats = gspo(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    torch.testing.assert_close(loss.detach(), _t([[-1.2] * 4, [0.9] * 4]), **TOL)
    # token-weighted: seq 0 (2 tokens) clipped, seq 1 (3 tokens) not -> 2/5
    assert stats["clip_fraction"] == pytest.approx(0.4, abs=1e-9)
    # (2 * 1.4142135624 + 3 * 0.9) / 5 = 5.5284271247 / 5
    assert stats["ratio_mean"] == pytest.approx(1.1056854249, abs=1e-9)
    assert (stats["ratio_max"], stats["ratio_min"]) == (pytest.approx(2 ** 0.5), pytest.approx(0.9))

    seq_mean_token_mean(loss, mask).backward()
    # (loss_0 + loss_1) / 2; d loss_1 / d logprob_1t = -A * s / |y| = 1.0 * 0.9 / 3 = 0.3, times 1/2 = 0.15;
    # seq 0 is clipped (0), padding gets nothing.
    torch.testing.assert_close(logprobs.grad, _t([[0.0, 0.0, 0.0, 0.0], [0.15, 0.15, 0.15, 0.0]]), **TOL)


# ------------------------------------------------------------ KL estimators


def test_kl_estimators_hand_computed():
    # token 0: pi_theta = 0.5, pi_ref = 0.25; token 1: pi_theta = 0.25, pi_ref = 0.5
    logprobs = _t([[math.log(0.5), math.log(0.25)]])
    ref = _t([[math.log(0.25), math.log(0.5)]])
    # k1 = ln(pi_theta / pi_ref): ln 2 = 0.6931471806, -ln 2
    torch.testing.assert_close(kl_k1(logprobs, ref), _t([[0.6931471806, -0.6931471806]]), **TOL)
    # k2 = (ln 2)^2 / 2 = 0.4804530139 / 2 = 0.2402265070 on both
    torch.testing.assert_close(kl_k2(logprobs, ref), _t([[0.2402265070, 0.2402265070]]), **TOL)
    # k3 = r - 1 - ln r, r = pi_ref / pi_theta: r = 0.5 -> -0.5 + 0.6931471806 = 0.1931471806;
    #                                            r = 2   ->  1.0 - 0.6931471806 = 0.3068528194
    torch.testing.assert_close(kl_k3(logprobs, ref), _t([[0.1931471806, 0.3068528194]]), **TOL)


def test_kl_k3_is_finite_on_extreme_log_ratios():
    # ln r = -100 - 0 clamped to -20: e^-20 - 1 + 20 = 19.0000000021
    value = kl_k3(_t([[0.0]]), _t([[-100.0]]))
    torch.testing.assert_close(value, _t([[19.0 + math.exp(-20.0)]]), **TOL)


def test_kl_registry():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    assert KL_ESTIMATORS.get("k3") is kl_k3


# -------------------------------------------------------------- aggregations

# Two sequences of unequal length; padded positions hold 100.0 to prove they are ignored.
#   seq 0: losses [1, 2, 3] (3 tokens), seq 1: losses [4] (1 token)
LOSS = [[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]]
AGG_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_token_mean_vs_seq_mean_token_mean_differ_on_unequal_lengths():
    loss, mask = _t(LOSS), _t(AGG_MASK)
    # token_mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    torch.testing.assert_close(token_mean(loss, mask), _t(2.5), **TOL)
    # seq_mean_token_mean: seq means (1+2+3)/3 = 2 and 4/1 = 4 -> (2 + 4) / 2 = 3.0
    torch.testing.assert_close(seq_mean_token_mean(loss, mask), _t(3.0), **TOL)


def test_aggregations_accept_bool_mask():
    loss, mask = _t(LOSS), _t(AGG_MASK).bool()
    torch.testing.assert_close(token_mean(loss, mask), _t(2.5), **TOL)
    torch.testing.assert_close(seq_mean_token_mean(loss, mask), _t(3.0), **TOL)
    torch.testing.assert_close(seq_mean_token_sum_norm(loss, mask, max_tokens=4), _t(1.25), **TOL)


def test_token_mean_num_tokens_override():
    # global token count 10 across ranks: (1 + 2 + 3 + 4) / 10 = 1.0
    torch.testing.assert_close(token_mean(_t(LOSS), _t(AGG_MASK), num_tokens=10), _t(1.0), **TOL)
    with pytest.raises(ValueError):
        token_mean(_t(LOSS), _t(AGG_MASK), num_tokens=0)


def test_seq_mean_token_mean_excludes_empty_sequences():
    # third sequence has no valid tokens -> still (2 + 4) / 2 = 3.0, not (2 + 4 + 0) / 3
    loss = _t(LOSS + [[7.0, 7.0, 7.0, 7.0]])
    mask = _t(AGG_MASK + [[0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(seq_mean_token_mean(loss, mask), _t(3.0), **TOL)


def test_seq_mean_token_sum_norm_dr_grpo():
    loss, mask = _t(LOSS), _t(AGG_MASK)
    # masked sum 1+2+3+4 = 10; B = 2, max_tokens = 4 -> 10 / (2 * 4) = 1.25
    torch.testing.assert_close(seq_mean_token_sum_norm(loss, mask, max_tokens=4), _t(1.25), **TOL)
    # generation budget 8 -> 10 / (2 * 8) = 0.625 (independent of the actual lengths)
    torch.testing.assert_close(seq_mean_token_sum_norm(loss, mask, max_tokens=8), _t(0.625), **TOL)
    # global num_sequences 5 -> 10 / (5 * 4) = 0.5
    torch.testing.assert_close(
        seq_mean_token_sum_norm(loss, mask, max_tokens=4, num_sequences=5), _t(0.5), **TOL
    )


def test_seq_mean_token_sum_norm_requires_max_tokens():
    with pytest.raises(TypeError):
        seq_mean_token_sum_norm(_t(LOSS), _t(AGG_MASK))


def test_all_masked_batch_gives_zero_not_nan():
    loss, mask = _t(LOSS), torch.zeros(2, 4, dtype=torch.float64)
    torch.testing.assert_close(token_mean(loss, mask), _t(0.0))
    torch.testing.assert_close(seq_mean_token_mean(loss, mask), _t(0.0))
    torch.testing.assert_close(masked_mean(loss, mask), _t(0.0))


def test_aggregation_gradient_only_reaches_valid_tokens():
    loss = _t(LOSS).requires_grad_(True)
    token_mean(loss, _t(AGG_MASK)).backward()
    # d/dloss of sum(loss*mask)/4 = mask / 4
    torch.testing.assert_close(loss.grad, _t([[0.25, 0.25, 0.25, 0.0], [0.25, 0.0, 0.0, 0.0]]), **TOL)


def test_registries():
    assert POLICY_LOSSES.get("ppo_clip") is ppo_clip
    assert POLICY_LOSSES.names() == ["decoupled_ppo", "gspo", "ppo_clip"]
    assert LOSS_AGGREGATIONS.names() == ["seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"]
    with pytest.raises(KeyError, match="unknown loss aggregation 'seq_sum'; available: seq_mean_token_mean"):
        LOSS_AGGREGATIONS.get("seq_sum")


# ------------------------------------------------------------------- helpers


def test_masked_mean():
    # (1 + 3) / 2 = 2.0; the 100 is masked out
    torch.testing.assert_close(masked_mean(_t([1.0, 100.0, 3.0]), _t([1.0, 0.0, 1.0])), _t(2.0), **TOL)


def test_entropy_from_logits():
    inf = float("inf")
    logits = _t(
        [
            [
                [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4 = 1.3862943611
                [0.0, math.log(3.0), -inf, -inf],  # p = [0.25, 0.75, 0, 0]:
                # 0.25*ln 4 + 0.75*ln(4/3) = 0.3465735903 + 0.2157615543 = 0.5623351446
                [5.0, 5.0, -inf, -inf],  # uniform over 2 (shift-invariant): ln 2 = 0.6931471806
            ]
        ]
    )
    entropy = entropy_from_logits(logits)
    assert entropy.shape == (1, 3)
    torch.testing.assert_close(entropy, _t([[1.3862943611, 0.5623351446, 0.6931471806]]), **TOL)


def test_token_logprobs():
    # softmax([0, ln 3]) = [0.25, 0.75]
    # token 1 -> ln 0.75 = -0.2876820725, token 0 -> ln 0.25 = -1.3862943611
    logits = _t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # [1, 2, 2]
    tokens = torch.tensor([[1, 0]])
    torch.testing.assert_close(token_logprobs(logits, tokens), _t([[-0.2876820725, -1.3862943611]]), **TOL)
