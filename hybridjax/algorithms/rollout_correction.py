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

Mismatch masks peers ship, by name (`algorithm.rollout_rs`, the registry below): `icepop`,
`sequence_mask` (TRL's default) and `off_policy_sequence_mask` (DeepSeek-V3.2). And the
mismatch itself, measured every step (`mismatch_metrics`: verl's `rollout_corr/*`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjax.algorithms.config import AlgorithmConfig
from hybridjax.algorithms.masked import masked_count, masked_mean, safe_divide
from hybridjax.algorithms.registry import ROLLOUT_REJECTIONS

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


# ----------------------------------------------------------------- mismatch, measured per step

RATIO_BAND = (0.9, 1.1)  # verl #6280's figure: the share of tokens whose ratio leaves it


def mismatch_metrics(
    trainer_log_probs_BxT: jax.Array, rollout_log_probs_BxT: jax.Array, response_mask_BxT: jax.Array
) -> dict[str, jax.Array]:
    """The rollout/trainer mismatch of one batch, every step: verl's `rollout_corr/*`
    diagnostics (`rollout_corr_helper.compute_offpolicy_metrics`) and peers' figures.

    With ρ_t = π_trainer / π_rollout per valid token and per-row means over the rows with a
    valid token: `kl` = mean(log π_rollout − log π_trainer), `k3_kl` = mean(ρ − log ρ − 1),
    `training_ppl` / `rollout_ppl` = row mean of exp(−row mean log π), `*_log_ppl` their logs,
    `log_ppl_diff{,_max,_min}` and `log_ppl_abs_diff` over rows of (rollout − trainer) row mean
    log-probs, `ppl_ratio` = row mean of exp(log_ppl_diff), `chi2_token` = mean(ρ²) − 1,
    `chi2_seq` = row mean of (Π_t ρ_t)² − 1; and `token_ratio_mean` = mean(ρ),
    `token_ratio_outside_frac` = share of tokens with ρ outside [0.9, 1.1] (verl #6280, TRL
    #6789), `max_abs_log_prob_diff` = max |log π_trainer − log π_rollout|. Log-ratios are
    clamped to ±20 before exp. All float32 scalars, 0 on an empty mask.
    """
    mask = response_mask_BxT.astype(jnp.float32)
    trainer = jax.lax.stop_gradient(trainer_log_probs_BxT)
    log_ratio = jnp.where(mask > 0, trainer - rollout_log_probs_BxT, 0.0)
    rho = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    rows = masked_count(mask, axis=-1) > 0
    train_row = masked_mean(trainer, mask, axis=-1)
    rollout_row = masked_mean(rollout_log_probs_BxT, mask, axis=-1)
    diff_row = rollout_row - train_row
    seq = jnp.clip(jnp.sum(log_ratio, axis=-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    low, high = RATIO_BAND
    m = {
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(rho - log_ratio - 1.0, mask),
        "training_ppl": masked_mean(jnp.exp(-train_row), rows),
        "training_log_ppl": masked_mean(-train_row, rows),
        "rollout_ppl": masked_mean(jnp.exp(-rollout_row), rows),
        "rollout_log_ppl": masked_mean(-rollout_row, rows),
        "log_ppl_diff": masked_mean(diff_row, rows),
        "log_ppl_abs_diff": masked_mean(jnp.abs(diff_row), rows),
        "log_ppl_diff_max": _masked_max(diff_row, rows),
        "log_ppl_diff_min": _masked_min(diff_row, rows),
        "ppl_ratio": masked_mean(jnp.exp(diff_row), rows),
        "chi2_token": masked_mean(jnp.square(rho), mask) - jnp.any(mask > 0),
        "chi2_seq": masked_mean(jnp.exp(2.0 * seq), rows) - jnp.any(rows),
        "token_ratio_mean": masked_mean(rho, mask),
        "token_ratio_outside_frac": masked_mean((rho < low) | (rho > high), mask),
        "max_abs_log_prob_diff": _masked_max(jnp.abs(log_ratio), mask),
    }
    return {f"rollout_corr/{k}": v.astype(jnp.float32) for k, v in m.items()}


# ------------------------------------------------- mismatch masks (algorithm.rollout_rs registry)
#
# An entry maps (log ρ B×T, response mask B×T, advantages B×T or None, lower, upper) to
# (weights B×T or None, keep B×T 0/1): the tokens it keeps, and where it reweights them, the
# weights the policy loss multiplies (as `rollout_is_weights`). Attributes: `stage`
# ("old_log_prob": ρ = π_old / π_rollout, before the advantages; "update": ρ = π_θ /
# π_rollout inside the loss, with the advantages), `default_threshold` and
# `default_threshold_lower` (None: no bound; `algorithm.rollout_rs_threshold{,_lower}` 0 = these).


def register_rollout_rs(
    name: str, stage: str, threshold: float | None, lower: float | None
) -> Callable[[Callable], Callable]:
    """Registers a mismatch mask as `algorithm.rollout_rs=name` (see the block comment)."""

    def decorator(fn: Callable) -> Callable:
        fn.stage, fn.default_threshold, fn.default_threshold_lower = stage, threshold, lower  # type: ignore[attr-defined]
        return ROLLOUT_REJECTIONS.register(name)(fn)

    return decorator


def _inside(x, lower, upper):
    above = x >= lower if lower is not None else jnp.ones_like(x, bool)
    return above & (x <= upper) if upper is not None else above


@register_rollout_rs("icepop", "old_log_prob", threshold=5.0, lower=0.5)
def icepop(log_ratio_BxT, mask_BxT, advantages_BxT, lower, upper):
    """IcePop (Ring-1T, inclusionAI 2025, "Every Step Evolves", §IcePop): a two-sided token
    mask, M(ρ) = ρ if α ≤ ρ ≤ β else 0, with ρ = π_old / π_rollout per token (α = 0.5, β = 5
    by default): tokens outside the band leave the loss, the others are weighted by ρ. verl
    writes it as `rollout_is=token` with `rollout_rs=token_k1`, threshold "α_β"."""
    rho = jnp.exp(jnp.clip(log_ratio_BxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = _inside(rho, lower, upper)
    return jnp.where(keep, rho, 0.0), keep


@register_rollout_rs("sequence_mask", "old_log_prob", threshold=3.0, lower=None)
def sequence_mask(log_ratio_BxT, mask_BxT, advantages_BxT, lower, upper):
    """TRL's default `vllm_importance_sampling_mode="sequence_mask"` (cap
    `vllm_importance_sampling_clip_max` 3.0, no lower bound): one ratio per sequence,
    ρ_seq = Π_t π_old / π_rollout; a sequence with ρ_seq outside [lower, cap] leaves the loss,
    the others are weighted by ρ_seq on every token."""
    seq = jnp.sum(jnp.where(mask_BxT > 0, log_ratio_BxT, 0.0), axis=-1, keepdims=True)
    rho = jnp.exp(jnp.clip(seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = jnp.broadcast_to(_inside(rho, lower, upper), log_ratio_BxT.shape)
    return jnp.where(keep, rho, 0.0), keep


@register_rollout_rs("off_policy_sequence_mask", "update", threshold=None, lower=None)
def off_policy_sequence_mask(log_ratio_BxT, mask_BxT, advantages_BxT, lower, upper):
    """DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9; TRL's
    `off_policy_mask_threshold`): a sequence leaves the loss when its advantage is negative
    and its mean token KL(π_rollout ‖ π_θ), mean_t(log π_rollout − log π_θ), exceeds δ
    (`algorithm.rollout_rs_threshold`, required). Computed in the update with the current π_θ
    (detached); no reweighting."""
    count = jnp.maximum(jnp.sum(mask_BxT, axis=-1, keepdims=True), 1.0)
    kl = jnp.sum(jnp.where(mask_BxT > 0, -log_ratio_BxT, 0.0), axis=-1, keepdims=True) / count
    advantage = jnp.sum(jnp.where(mask_BxT > 0, advantages_BxT, 0.0), -1, keepdims=True) / count
    negative = advantage < 0  # the sequence's (mean) advantage
    keep = ~(negative & (kl > upper))
    return None, jnp.broadcast_to(keep, log_ratio_BxT.shape)


def rollout_rejection(
    log_ratio_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    config: AlgorithmConfig,
    advantages_BxT: jax.Array | None = None,
) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
    """`algorithm.rollout_rs`'s entry on one batch: (weights B×T float32 or None, the
    response mask with the rejected tokens at 0, metrics `rollout_corr/rollout_rs_*`:
    `masked_fraction` of valid tokens and `seq_masked_fraction` of rows with a valid token
    that lost one, verl's names). Raises ValueError if no entry is configured."""
    if not config.rollout_rs:
        raise ValueError("rollout_rejection needs algorithm.rollout_rs")
    fn = ROLLOUT_REJECTIONS.get(config.rollout_rs)
    upper, lower = config.resolved_rollout_rs_thresholds
    mask = response_mask_BxT.astype(jnp.float32)
    log_ratio = jax.lax.stop_gradient(jnp.where(mask > 0, log_ratio_BxT, 0.0))
    weights, keep = fn(log_ratio, mask, advantages_BxT, lower, upper)
    new_mask = mask * keep
    lost = (mask > 0) & (new_mask == 0)
    rows = masked_count(mask, axis=-1) > 0
    metrics = {
        "rollout_corr/rollout_rs_masked_fraction": masked_mean(lost, mask),
        "rollout_corr/rollout_rs_seq_masked_fraction": masked_mean(jnp.any(lost, -1), rows),
    }
    if weights is not None:
        weights = jax.lax.stop_gradient(weights * new_mask)
        metrics["rollout_corr/rollout_rs_mean"] = masked_mean(weights, new_mask)
    return weights, new_mask.astype(response_mask_BxT.dtype), metrics
