"""The mismatch masks of `algorithm.rollout_rs` and the per-step mismatch metrics
(`hybridjax.algorithms.rollout_correction`), on hand-valued ratios."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.algorithms.config import AlgorithmConfig
from hybridjax.algorithms.rollout_correction import mismatch_metrics, rollout_rejection

LN = np.log
# per-token ratios π_trainer / π_rollout of two rows; row 1 has 2 valid tokens
RATIOS = np.array([[1.0, 0.4, 2.0, 6.0], [1.5, 1.2, 1.0, 1.0]], np.float32)
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.float32)
ROLLOUT = np.full((2, 4), -1.0, np.float32)
TRAINER = ROLLOUT + LN(RATIOS)


def _rs(name, advantages=None, **kw):
    config = AlgorithmConfig(rollout_rs=name, **kw)
    return rollout_rejection(jnp.asarray(LN(RATIOS)), jnp.asarray(MASK), config, advantages)


def test_icepop_keeps_tokens_inside_the_band_weighted_by_their_ratio():
    """α = 0.5, β = 5: 0.4 and 6.0 leave; the rest keep weight ρ."""
    weights, mask, m = _rs("icepop")
    np.testing.assert_array_equal(mask, [[1, 0, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_allclose(weights, [[1.0, 0, 2.0, 0], [1.5, 1.2, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_masked_fraction"], 2 / 6)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_mean"], (1 + 2 + 1.5 + 1.2) / 4)
    _, mask, _ = _rs("icepop", rollout_rs_threshold=10.0, rollout_rs_threshold_lower=0.3)
    np.testing.assert_array_equal(mask, MASK)


def test_sequence_mask_caps_the_sequence_ratio_at_three():
    """ρ_seq: row 0 = 1 · 0.4 · 2 · 6 = 4.8 > 3 (dropped), row 1 = 1.5 · 1.2 = 1.8 (kept,
    weight 1.8 on its tokens; padding does not count)."""
    weights, mask, m = _rs("sequence_mask")
    np.testing.assert_array_equal(mask, [[0, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_allclose(weights, [[0, 0, 0, 0], [1.8, 1.8, 0, 0]], rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    _, mask, _ = _rs("sequence_mask", rollout_rs_threshold=5.0)
    np.testing.assert_array_equal(mask, MASK)


def test_off_policy_sequence_mask_drops_negative_advantage_far_sequences():
    """Mean KL(π_rollout ‖ π_θ) = −mean log ρ: row 0 −(0 + ln 0.4 + ln 2 + ln 6)/4 = −0.392,
    row 1 −(ln 1.5 + ln 1.2)/2 = −0.294. δ = −0.35: only row 1 is beyond it, and it is dropped
    only with a negative advantage."""
    adv = jnp.asarray([[1.0] * 4, [-1.0] * 4])
    _, mask, m = _rs("off_policy_sequence_mask", adv, rollout_rs_threshold=-0.35)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 0, 0, 0]])
    assert "rollout_corr/rollout_rs_mean" not in m
    _, mask, _ = _rs("off_policy_sequence_mask", -adv, rollout_rs_threshold=-0.35)
    np.testing.assert_array_equal(mask, MASK)  # row 0 negative, but within δ
    _, mask, _ = _rs("off_policy_sequence_mask", adv, rollout_rs_threshold=0.1)
    np.testing.assert_array_equal(mask, MASK)


def test_config_checks_the_name_and_the_threshold():
    with pytest.raises(ValueError, match="valid names: icepop, off_policy_sequence_mask"):
        AlgorithmConfig(rollout_rs="icepops")
    with pytest.raises(ValueError, match="needs algorithm.rollout_rs_threshold"):
        AlgorithmConfig(rollout_rs="off_policy_sequence_mask")
    config = AlgorithmConfig(rollout_rs="icepop")
    assert config.resolved_rollout_rs_thresholds == (5.0, 0.5)
    assert config.uses_rollout_is_weights and config.rollout_rs_stage == "old_log_prob"


def test_mismatch_metrics_by_hand():
    """Valid ratios 1, 0.4, 2, 6, 1.5, 1.2: outside [0.9, 1.1] are 0.4, 2, 6, 1.5, 1.2."""
    m = mismatch_metrics(jnp.asarray(TRAINER), jnp.asarray(ROLLOUT), jnp.asarray(MASK))
    valid = RATIOS[MASK > 0]
    np.testing.assert_allclose(m["rollout_corr/token_ratio_outside_frac"], 5 / 6, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/token_ratio_mean"], valid.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/max_abs_log_prob_diff"], LN(6.0), rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/kl"], -LN(valid).mean(), rtol=1e-5)
    k3 = valid - LN(valid) - 1
    np.testing.assert_allclose(m["rollout_corr/k3_kl"], k3.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/chi2_token"], (valid**2).mean() - 1, rtol=1e-5)
    seq = np.array([4.8, 1.8])
    np.testing.assert_allclose(m["rollout_corr/chi2_seq"], (seq**2).mean() - 1, rtol=1e-5)
    # per row: rollout mean log-prob −1, trainer's −1 + mean log ρ
    diff = -np.array([LN(RATIOS[0]).mean(), LN(RATIOS[1, :2]).mean()])
    np.testing.assert_allclose(m["rollout_corr/log_ppl_diff"], diff.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/ppl_ratio"], np.exp(diff).mean(), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/rollout_ppl"], np.e, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/training_ppl"], np.exp(1 + diff).mean(), rtol=1e-5)
