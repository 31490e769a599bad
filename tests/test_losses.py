"""Policy loss, aggregations and token helpers, against hand-computed values."""

import math

import pytest
import torch

from operators.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    entropy_from_logits,
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
    assert stats == {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0}


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
