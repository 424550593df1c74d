"""Loss aggregation with global counts, so micro-batching never changes the gradient.

verl shipped losses whose value depended on the micro-batch size: each micro-batch averaged over
its own tokens, and the micro-batch means were averaged again. Here every aggregate is a *sum*
over the rows at hand divided by a denominator counted once over the whole mini-batch
(`LossCounts`). The loss of a mini-batch is then the plain sum of its micro-batch losses, so
summing micro-batch gradients gives exactly the full mini-batch gradient, for any split over
micro-batches or devices.

    counts = loss_counts(mini_batch.response_mask)          # once per mini-batch
    loss = sum(agg_loss(l, m, mode, counts) for (l, m) in micro_batches)

Without `counts` the rows at hand are the whole mini-batch (the plain means).

Modes (verl's `actor.loss_agg_mode` / `critic.loss_agg_mode`), with L_bt the per-token loss,
m_bt the mask, n_b = Σ_t m_bt, N = Σ_b n_b and S = #{b : n_b > 0}:

* `token-mean`:               Σ_bt L·m / N
* `seq-mean-token-sum`:       Σ_b (Σ_t L·m) / S
* `seq-mean-token-mean`:      Σ_b (Σ_t L·m / n_b) / S
* `seq-mean-token-sum-norm`:  Σ_bt L·m / loss_scale_factor (default: the padded length T;
  Dr.GRPO's constant normaliser, arXiv:2503.20783)

A sequence with no valid token adds nothing and is not counted in S.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybridjax.algorithms.masked import masked_count, masked_sum, safe_divide

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


class LossCounts(NamedTuple):
    """Denominators of a whole mini-batch (float32 scalars; a pytree, so it can be traced)."""

    num_tokens: jax.Array  # valid tokens
    num_seqs: jax.Array  # sequences with at least one valid token


def loss_counts(response_mask_BxT: jax.Array) -> LossCounts:
    """Counts over the whole mini-batch; compute before splitting it into micro-batches."""
    tokens_B = masked_count(response_mask_BxT, axis=-1)
    return LossCounts(jnp.sum(tokens_B), jnp.sum((tokens_B > 0).astype(jnp.float32)))


def check_loss_agg_mode(loss_agg_mode: str) -> str:
    """Returns `loss_agg_mode` if known; raises ValueError listing the valid modes."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    return loss_agg_mode


def agg_loss(
    loss_mat_BxT: jax.Array,
    loss_mask_BxT: jax.Array,
    loss_agg_mode: str,
    counts: LossCounts | None = None,
    loss_scale_factor: float | None = None,
) -> jax.Array:
    """Aggregates a per-token loss into this micro-batch's share of the mini-batch loss (scalar).

    `loss_mat_BxT` float32; `loss_mask_BxT` 0/1 (values outside it are ignored, even NaN);
    `counts` from `loss_counts` over the mini-batch (None: these rows are the mini-batch);
    `loss_scale_factor` only for `seq-mean-token-sum-norm`. Raises ValueError on an unknown mode.
    """
    check_loss_agg_mode(loss_agg_mode)
    if counts is None:
        counts = loss_counts(loss_mask_BxT)
    if loss_agg_mode == "token-mean":
        return safe_divide(masked_sum(loss_mat_BxT, loss_mask_BxT), counts.num_tokens)
    seq_sum_B = masked_sum(loss_mat_BxT, loss_mask_BxT, axis=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return safe_divide(jnp.sum(seq_sum_B), counts.num_seqs)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mean_B = safe_divide(seq_sum_B, masked_count(loss_mask_BxT, axis=-1))
        return safe_divide(jnp.sum(seq_mean_B), counts.num_seqs)
    scale = loss_mat_BxT.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return jnp.sum(seq_sum_B) / scale


def token_mean(values_BxT: jax.Array, mask_BxT: jax.Array, counts: LossCounts | None) -> jax.Array:
    """This micro-batch's share of a mini-batch token mean (metrics; sum over micro-batches)."""
    return agg_loss(values_BxT.astype(jnp.float32), mask_BxT, "token-mean", counts)
