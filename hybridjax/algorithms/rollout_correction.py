"""Rollout/trainer mismatch: truncated importance sampling and mismatch metrics.

The sampler's log-probs (`rollout_log_probs`, e.g. bf16 paged decode) differ from the trainer's
(`old_log_probs`, recomputed on the training layout). The policy gradient is an expectation
under the trainer's old policy, so each token (or sequence) is re-weighted by
w = π_old / π_rollout, bounded for variance (Yao et al. 2025 "Your efficient RL framework
secretly brings you off-policy RL training"; verl `mismatch_helper.py`).

* `rollout_is_level`: `token` (w_t), `sequence` (Π_t w_t, one weight per row) or `geometric`
  ((Π_t w_t)^(1/n), one weight per row). Log-ratios are clamped to ±20 before exp.
* `rollout_is_mode`: `truncate` (w ← min(w, upper), TIS) or `mask` (weights stay the true
  ratios; tokens/rows with w outside [lower, upper] are dropped from the response mask).
* `rollout_is_veto_threshold`: a row with any token ratio below it is dropped from the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax.algorithms.config import AlgorithmConfig
from hybridjax.algorithms.masked import masked_count, masked_mean, safe_divide

LOG_RATIO_CLAMP = 20.0


def _masked_max(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(jnp.any(mask > 0), jnp.max(jnp.where(mask > 0, values, -jnp.inf)), 0.0)


def _masked_min(values: jax.Array, mask: jax.Array) -> jax.Array:
    return -_masked_max(-values, mask)


def compute_rollout_importance_weights(
    old_log_prob_BxT: jax.Array,
    rollout_log_probs_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    config: AlgorithmConfig,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Importance weights π_old/π_rollout and the (possibly reduced) response mask.

    Returns (rollout_is_weights_BxT float32, 0 on padding and without gradient;
    response_mask_BxT, changed only by `mask` mode and the veto; metrics `mismatch/*`).
    Raises ValueError if `config.rollout_is_threshold` is None (IS disabled).
    Example: rollout −2.0, trainer −1.0 → w = e = 2.718; truncated at 2.0 → 2.0.
    """
    if config.rollout_is_threshold is None:
        raise ValueError("rollout importance sampling needs algorithm.rollout_is_threshold")
    upper = config.rollout_is_threshold
    lower = config.resolved_rollout_is_threshold_lower
    assert lower is not None  # set whenever the upper threshold is (checked above)
    mask_BxT = response_mask_BxT.astype(jnp.float32)
    old_log_prob_BxT = jax.lax.stop_gradient(old_log_prob_BxT)
    log_ratio_BxT = jnp.where(mask_BxT > 0, old_log_prob_BxT - rollout_log_probs_BxT, 0.0)
    if config.rollout_is_level == "token":
        log_weight_BxT = log_ratio_BxT
    else:
        seq_log_ratio_B = jnp.sum(log_ratio_BxT, axis=-1)
        if config.rollout_is_level == "geometric":
            seq_log_ratio_B = safe_divide(seq_log_ratio_B, masked_count(mask_BxT, axis=-1))
        log_weight_BxT = jnp.broadcast_to(seq_log_ratio_B[:, None], mask_BxT.shape)
    raw_weights_BxT = (
        jnp.exp(jnp.clip(log_weight_BxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * mask_BxT
    )

    new_mask_BxT = mask_BxT
    if config.rollout_is_mode == "truncate":
        weights_BxT = jnp.minimum(raw_weights_BxT, upper)
    else:
        weights_BxT = raw_weights_BxT
        inside_BxT = (raw_weights_BxT >= lower) & (raw_weights_BxT <= upper)
        new_mask_BxT = new_mask_BxT * inside_BxT
    vetoed_B = jnp.zeros(mask_BxT.shape[0], bool)
    if config.rollout_is_veto_threshold is not None:
        token_ratio_BxT = jnp.exp(jnp.clip(log_ratio_BxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        vetoed_B = jnp.any(
            (token_ratio_BxT < config.rollout_is_veto_threshold) & (mask_BxT > 0), -1
        )
        new_mask_BxT = new_mask_BxT * ~vetoed_B[:, None]

    has_tokens_B = masked_count(mask_BxT, axis=-1) > 0
    metrics = {
        "mismatch/rollout_is_mean": masked_mean(weights_BxT, mask_BxT),
        "mismatch/rollout_is_max": _masked_max(raw_weights_BxT, mask_BxT),
        "mismatch/rollout_is_min": _masked_min(raw_weights_BxT, mask_BxT),
        "mismatch/rollout_is_ratio_fraction_high": masked_mean(raw_weights_BxT > upper, mask_BxT),
        "mismatch/rollout_is_ratio_fraction_low": masked_mean(raw_weights_BxT < lower, mask_BxT),
        "mismatch/rollout_is_masked_fraction": masked_mean(new_mask_BxT == 0, mask_BxT),
        "mismatch/rollout_is_veto_fraction": masked_mean(vetoed_B, has_tokens_B),
        "mismatch/mismatch_kl": masked_mean(-log_ratio_BxT, mask_BxT),
    }
    return jax.lax.stop_gradient(weights_BxT), new_mask_BxT.astype(response_mask_BxT.dtype), metrics


def rollout_probs_diff_metrics(
    old_log_prob_BxT: jax.Array, rollout_log_probs_BxT: jax.Array, response_mask_BxT: jax.Array
) -> dict[str, jax.Array]:
    """|π_old − π_rollout| per valid token: `training/rollout_probs_diff_{mean,max,std}` (verl)."""
    diff_BxT = jnp.abs(jnp.exp(old_log_prob_BxT) - jnp.exp(rollout_log_probs_BxT))
    mean = masked_mean(diff_BxT, response_mask_BxT)
    var = masked_mean(jnp.square(diff_BxT - mean), response_mask_BxT)
    return {
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_max": _masked_max(diff_BxT, response_mask_BxT),
        "training/rollout_probs_diff_std": jnp.sqrt(var),
    }
