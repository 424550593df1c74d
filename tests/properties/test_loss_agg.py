"""Properties of loss aggregation (`hybridjax.algorithms.loss_agg`): every mode equals its
formula written out in numpy, and with the mini-batch's counts the micro-batch shares sum to the
mini-batch loss for any split of the rows.

Formulas (the module docstring; verl's `agg_loss` modes), with n_b = Σ_t m_bt, N = Σ_b n_b and
S = #{b : n_b > 0}: token-mean Σ L·m / N; seq-mean-token-sum Σ_b (Σ_t L·m) / S;
seq-mean-token-mean Σ_b (Σ_t L·m / n_b) / S; seq-mean-token-sum-norm Σ L·m / (factor or T).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hybridjax.algorithms.loss_agg import LOSS_AGG_MODES, agg_loss, loss_counts

FAST = settings(max_examples=25, deadline=None)
B, T = 6, 5  # one shape: every example reuses the same compiled programs

losses = hnp.arrays(np.float32, (B, T), elements=st.floats(-10, 10, width=32))
masks = hnp.arrays(np.float32, (B, T), elements=st.sampled_from([0.0, 1.0]))


def by_hand(loss, mask, mode, factor=None):
    """The formulas of the module docstring, row by row in float64."""
    loss, mask = loss.astype(np.float64), mask.astype(np.float64)
    n = mask.sum(axis=1)
    seq_sum = (loss * mask).sum(axis=1)
    s = (n > 0).sum()
    if mode == "token-mean":
        return seq_sum.sum() / n.sum() if n.sum() else 0.0
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / s if s else 0.0
    if mode == "seq-mean-token-mean":
        means = [seq_sum[b] / n[b] for b in range(len(n)) if n[b] > 0]
        return sum(means) / s if s else 0.0
    return seq_sum.sum() / (loss.shape[1] if factor is None else factor)


@FAST
@given(loss=losses, mask=masks, mode=st.sampled_from(LOSS_AGG_MODES))
def test_each_mode_equals_its_formula(loss, mask, mode):
    got = float(agg_loss(jnp.asarray(loss), jnp.asarray(mask), mode))
    np.testing.assert_allclose(got, by_hand(loss, mask, mode), rtol=1e-5, atol=1e-5)


@FAST
@given(loss=losses, mask=masks, factor=st.floats(0.5, 100.0))
def test_norm_mode_divides_by_the_given_factor(loss, mask, factor):
    mode = "seq-mean-token-sum-norm"
    got = float(agg_loss(jnp.asarray(loss), jnp.asarray(mask), mode, loss_scale_factor=factor))
    np.testing.assert_allclose(got, by_hand(loss, mask, mode, factor), rtol=1e-5, atol=1e-5)


@FAST
@given(
    loss=losses,
    mask=masks,
    mode=st.sampled_from(LOSS_AGG_MODES),
    assignment=st.lists(st.integers(0, 2), min_size=B, max_size=B),
)
def test_micro_batch_shares_sum_to_the_mini_batch_loss(loss, mask, mode, assignment):
    """Rows dealt into up to 3 micro-batches in any way (the padded rows of each micro-batch
    masked out, so shapes stay fixed): Σ shares with the mini-batch counts = mini-batch loss."""
    loss_j, mask_j = jnp.asarray(loss), jnp.asarray(mask)
    counts = loss_counts(mask_j)
    chunks = np.asarray(assignment)
    shares = [
        float(
            agg_loss(loss_j, mask_j * jnp.asarray(chunks == c, np.float32)[:, None], mode, counts)
        )
        for c in range(3)
    ]
    whole = float(agg_loss(loss_j, mask_j, mode))
    np.testing.assert_allclose(sum(shares), whole, rtol=1e-5, atol=1e-5)


@FAST
@given(loss=losses, mask=masks, mode=st.sampled_from(LOSS_AGG_MODES))
def test_values_outside_the_mask_are_ignored(loss, mask, mode):
    poisoned = np.where(mask > 0, loss, np.nan).astype(np.float32)
    got = float(agg_loss(jnp.asarray(poisoned), jnp.asarray(mask), mode))
    np.testing.assert_allclose(got, by_hand(loss, mask, mode), rtol=1e-5, atol=1e-5)
