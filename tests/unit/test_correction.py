"""Mismatch correction (TIS, MIS) and its statistics, against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from operators.algorithms.correction import (
    MIS_MODES,
    TIS_MODES,
    CorrectionSettings,
    behavior_log_ratio,
    correction_factors,
    merge_mismatch,
    mis_geometric,
    mis_sequence,
    mis_token,
    mismatch_sums,
    tis_factor,
    tis_sequence,
    tis_token,
)

TOL = dict(atol=1e-6, rtol=1e-6)


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


# One response of 3 tokens + 1 padded, rho = pi_prox / pi_behave = [4, 0.5, 1] (padding: log rho 0).
LOG_RHO = _t([[math.log(4.0), math.log(0.5), 0.0, 0.0]])
MASK = _t([[1.0, 1.0, 1.0, 0.0]])


def test_behavior_log_ratio_is_detached_clamped_and_zero_on_padding():
    proximal = _t([[0.0, -1.0, 0.0]]).requires_grad_(True)
    behavior = _t([[-1000.0, -0.5, -7.0]])
    log_rho = behavior_log_ratio(proximal, behavior, _t([[1.0, 1.0, 0.0]]))
    # 0 - (-1000) = 1000 -> clamped to 20; -1 - (-0.5) = -0.5; padded -> 0
    torch.testing.assert_close(log_rho, _t([[20.0, -0.5, 0.0]]), **TOL)
    assert not log_rho.requires_grad


def test_tis_token_truncates_each_token_at_the_cap():
    # the weight to cap is rho_t itself (its log); the factor min(rho, cap) / rho with cap 2 is
    # [2/4, 1, 1] -> effective weights rho * factor = [2, 0.5, 1]
    log_weight = tis_token(LOG_RHO, MASK)
    torch.testing.assert_close(log_weight, LOG_RHO, **TOL)
    torch.testing.assert_close(tis_factor(LOG_RHO, log_weight, 2.0)[:, :3], _t([[0.5, 1.0, 1.0]]), **TOL)


def test_tis_sequence_truncates_the_response_ratio():
    # the weight to cap is prod rho = 4 * 0.5 * 1 = 2 on every token (its log). The loss carries rho_t,
    # so the factor is min(2, cap) / rho_t: cap 1.5 -> [0.375, 3, 1.5] (effective weight 1.5 on every
    # token); cap 2.5 -> 2 / rho_t = [0.5, 4, 2] (effective weight 2, the untruncated product)
    log_weight = tis_sequence(LOG_RHO, MASK)
    torch.testing.assert_close(log_weight[:, :3], _t([[math.log(2.0)] * 3]), **TOL)
    torch.testing.assert_close(tis_factor(LOG_RHO, log_weight, 1.5)[:, :3], _t([[0.375, 3.0, 1.5]]), **TOL)
    torch.testing.assert_close(tis_factor(LOG_RHO, log_weight, 2.5)[:, :3], _t([[0.5, 4.0, 2.0]]), **TOL)
    factor, truncated, _ = correction_factors(LOG_RHO, MASK, CorrectionSettings(tis="sequence", tis_cap=1.5))
    torch.testing.assert_close(factor[:, :3], _t([[0.375, 3.0, 1.5]]), **TOL)
    assert truncated.tolist() == [[True, True, True, False]]  # the whole response, never the padding
    _, truncated, _ = correction_factors(LOG_RHO, MASK, CorrectionSettings(tis="sequence", tis_cap=2.5))
    assert not truncated.any()


def test_mis_token_sequence_and_geometric():
    # token, [0.5, 2]: rho 4 is out, 0.5 (bound, inclusive) and 1 are in
    torch.testing.assert_close(mis_token(LOG_RHO, MASK, low=0.5, high=2.0)[:, :3], _t([[0.0, 1.0, 1.0]]))
    # sequence on prod rho = 2: inside [0.5, 3] -> keep all; outside [0.5, 1.5] -> drop all
    torch.testing.assert_close(mis_sequence(LOG_RHO, MASK, low=0.5, high=3.0)[:, :3], _t([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(mis_sequence(LOG_RHO, MASK, low=0.5, high=1.5)[:, :3], _t([[0.0, 0.0, 0.0]]))
    # geometric mean over the 3 valid tokens: 2^(1/3) = 1.2599210: out of [0.5, 1.2], in [0.5, 1.3]
    torch.testing.assert_close(mis_geometric(LOG_RHO, MASK, low=0.5, high=1.2)[:, :3], _t([[0.0, 0.0, 0.0]]))
    torch.testing.assert_close(mis_geometric(LOG_RHO, MASK, low=0.5, high=1.3)[:, :3], _t([[1.0, 1.0, 1.0]]))


def test_correction_factors_combine_tis_and_mis_and_never_touch_padding():
    settings = CorrectionSettings(tis="token", tis_cap=2.0, mis="token", mis_low=0.6, mis_high=5.0)
    factor, truncated, masked = correction_factors(LOG_RHO, MASK, settings)
    # TIS [0.5, 1, 1] times MIS keep on [0.6, 5]: rho 0.5 is dropped -> [0.5, 0, 1]
    torch.testing.assert_close(factor[:, :3], _t([[0.5, 0.0, 1.0]]), **TOL)
    assert truncated.tolist() == [[True, False, False, False]]
    assert masked.tolist() == [[False, True, False, False]]
    off, none_truncated, none_masked = correction_factors(LOG_RHO, MASK, CorrectionSettings())
    torch.testing.assert_close(off, torch.ones_like(LOG_RHO))
    assert not none_truncated.any() and not none_masked.any()


def test_registries():
    assert TIS_MODES.names() == ["sequence", "token"]
    assert MIS_MODES.names() == ["geometric", "sequence", "token"]


# ------------------------------------------------------------------ statistics

# Two responses: staleness 0 with rho [2, 0.5], staleness 1 with rho [1] (+ padding).
#   k1 = -ln rho: [-0.6931472, 0.6931472, 0]          -> mean 0
#   k3 = rho - 1 - ln rho: [1 - 0.6931472, -0.5 + 0.6931472, 0] = [0.3068528, 0.1931472, 0]
#        -> mean 0.5 / 3 = 0.1666667; staleness 0: 0.5 / 2 = 0.25; staleness 1: 0
#   rho mean (2 + 0.5 + 1) / 3 = 1.1666667; staleness 0: 1.25, staleness 1: 1.0
def _part():
    log_rho = _t([[math.log(2.0), math.log(0.5)], [0.0, 0.0]])
    mask = _t([[1.0, 1.0], [1.0, 0.0]])
    truncated = torch.tensor([[True, False], [False, False]])
    masked = torch.tensor([[False, False], [True, False]])
    return mismatch_sums(log_rho, mask, torch.tensor([0, 1]), truncated, masked)


def test_mismatch_statistics_overall_and_by_staleness():
    metrics = merge_mismatch([_part()])
    assert metrics["is_ratio_mean"] == pytest.approx(3.5 / 3)
    assert (metrics["is_ratio_max"], metrics["is_ratio_min"]) == (pytest.approx(2.0), pytest.approx(0.5))
    assert metrics["mismatch_k1"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["mismatch_k3"] == pytest.approx(0.5 / 3)
    assert metrics["tis_fraction"] == pytest.approx(1 / 3) and metrics["mis_fraction"] == pytest.approx(1 / 3)
    assert metrics["mismatch_k3_staleness_0"] == pytest.approx(0.25)
    assert metrics["is_ratio_mean_staleness_0"] == pytest.approx(1.25)
    assert metrics["tis_fraction_staleness_0"] == pytest.approx(0.5)
    assert metrics["mismatch_k3_staleness_1"] == pytest.approx(0.0)
    assert metrics["mis_fraction_staleness_1"] == pytest.approx(1.0)
    assert metrics["is_tokens_staleness_0"] == 2 and metrics["is_tokens_staleness_1"] == 1
    # one part: its quantiles exactly. ln rho sorted [-ln2, 0, ln2]: p50 -> 0 (rho 1);
    # p90 at position 0.9 * 2 = 1.8 -> 0.8 ln 2 (rho 2^0.8 = 1.7411011); p99 -> 2^0.98 = 1.9724654
    assert metrics["is_ratio_p50"] == pytest.approx(1.0)
    assert metrics["is_ratio_p90"] == pytest.approx(2 ** 0.8)
    assert metrics["is_ratio_p99"] == pytest.approx(2 ** 0.98)


def test_merging_parts_is_token_weighted():
    # second part (another rank): one token, staleness 1, rho 4: k3 = 3 - ln 4 = 1.6137056
    other = mismatch_sums(_t([[math.log(4.0)]]), _t([[1.0]]), torch.tensor([1]),
                          torch.tensor([[False]]), torch.tensor([[False]]))
    metrics = merge_mismatch([_part(), other])
    # overall: (2 + 0.5 + 1 + 4) / 4 = 1.875; staleness 1: (1 + 4) / 2 = 2.5, k3 (0 + 1.6137056) / 2
    assert metrics["is_ratio_mean"] == pytest.approx(1.875)
    assert metrics["is_ratio_max"] == pytest.approx(4.0)
    assert metrics["is_ratio_mean_staleness_1"] == pytest.approx(2.5)
    assert metrics["mismatch_k3_staleness_1"] == pytest.approx((3.0 - math.log(4.0)) / 2)
    assert metrics["tis_fraction"] == pytest.approx(1 / 4)  # 1 truncated token of 4
    assert metrics["is_ratio_max_staleness_0"] == pytest.approx(2.0)


def test_merged_quantiles_approximate_the_pooled_ones():
    # two ranks with different distributions and token counts; the sketch merge stays within 2%
    rng = np.random.default_rng(0)
    logs = [rng.normal(0.0, 0.1, size=3000), rng.normal(0.2, 0.3, size=1000)]
    parts = [mismatch_sums(_t(values[None, :]), torch.ones(1, values.size), torch.tensor([0]),
                           torch.zeros(1, values.size, dtype=torch.bool), torch.zeros(1, values.size, dtype=torch.bool))
             for values in logs]
    metrics = merge_mismatch(parts)
    pooled = np.exp(np.concatenate(logs))
    for name, level in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        assert metrics[f"is_ratio_{name}"] == pytest.approx(np.quantile(pooled, level), rel=0.02), name


def test_no_tokens_no_metrics():
    empty = mismatch_sums(_t([[0.0]]), _t([[0.0]]), torch.tensor([0]), torch.tensor([[False]]), torch.tensor([[False]]))
    assert merge_mismatch([empty]) == {}
