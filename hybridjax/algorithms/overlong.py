"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

A response of L tokens, with maximum length L_max and buffer L_buf, is penalised by
min(−(L − (L_max − L_buf)) / L_buf · factor, 0): nothing up to L_max − L_buf, then linearly down
to −factor at L_max. Config: `reward_model.overlong_buffer.{enable,len,penalty_factor}`
(`OverlongBufferConfig`), L_max = `data.max_response_length`. Source: verl `DAPORewardManager`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax.algorithms.masked import masked_count


def overlong_penalty(
    response_length_B: jax.Array,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> jax.Array:
    """Penalty (≤ 0, float32, shape of `response_length_B`) for responses of the given lengths.

    Example: L_max 512, buffer 128, factor 1, L = 480 → −0.75; L ≤ 384 → 0.
    """
    if overlong_buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be > 0, got {overlong_buffer_len}")
    expected_length = max_response_length - overlong_buffer_len
    exceed = response_length_B.astype(jnp.float32) - expected_length
    return jnp.minimum(-exceed / overlong_buffer_len * penalty_factor, 0.0)


def last_valid_token_one_hot(response_mask_BxT: jax.Array) -> jax.Array:
    """1.0 at the last valid position of each row (float32 B×T); an empty row is all 0."""
    length = response_mask_BxT.shape[-1]
    valid_BxT = response_mask_BxT > 0
    last_B = length - 1 - jnp.argmax(valid_BxT[:, ::-1], axis=-1)
    one_hot_BxT = jax.nn.one_hot(last_B, length, dtype=jnp.float32)
    return one_hot_BxT * jnp.any(valid_BxT, axis=-1, keepdims=True)


def apply_overlong_penalty(
    token_level_scores_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Adds the penalty at each response's last valid token (where the score sits).

    The length is the number of valid tokens. Returns (scores_BxT, penalty_B); a response with no
    valid token gets nothing.
    """
    penalty_B = overlong_penalty(
        masked_count(response_mask_BxT, axis=-1),
        max_response_length=max_response_length,
        overlong_buffer_len=overlong_buffer_len,
        penalty_factor=penalty_factor,
    )
    one_hot_BxT = last_valid_token_one_hot(response_mask_BxT)
    return token_level_scores_BxT + penalty_B[:, None] * one_hot_BxT, penalty_B
