"""Masked statistics over valid tokens: sum, mean, variance, whitening.

All functions are pure `jnp`, work on any shape and never divide by zero: statistics over an
empty mask are 0 (verl raises instead, which would need a host sync). Masks are 0/1 arrays of
any dtype (bool, int or float) broadcastable to `values`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8  # added to the variance before rsqrt, as verl's masked_whiten


def masked_sum(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ values·mask over `axis` (all axes if None). Positions outside the mask may hold NaN/inf."""
    return jnp.sum(jnp.where(mask > 0, values * mask, 0.0), axis=axis)


def masked_count(mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ mask over `axis`, as float32."""
    return jnp.sum(mask.astype(jnp.float32), axis=axis)


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator, and 0 where the denominator is 0."""
    ok = denominator != 0
    return jnp.where(ok, numerator / jnp.where(ok, denominator, 1.0), 0.0)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of `values` over valid positions along `axis`; 0 where nothing is valid."""
    return safe_divide(masked_sum(values, mask, axis), masked_count(mask, axis))


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of `values` over all valid positions (a scalar).

    With `unbiased`, Bessel's correction n/(n−1) is applied (as verl's `masked_var`). With fewer
    than two valid positions the variance is 0 (verl raises).
    """
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = masked_count(mask)
        var = jnp.where(n > 1, var * n / jnp.maximum(n - 1, 1.0), 0.0)
    return var


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """(values − mean) / sqrt(var + 1e-8) with mean and unbiased var over valid positions.

    Statistics are taken over the whole array (under SPMD: the global batch). Positions outside
    the mask come back as 0. With `shift_mean=False` the mean is added back after scaling.
    Source: verl `masked_whiten` (`verl/utils/torch_functional.py`).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask > 0, whitened, 0.0)
