"""Per-step data metrics with verl's names (`verl/trainer/ppo/metric_utils.py`).

`compute_data_metrics` is pure `jnp` and runs inside jit; the values stay on device until the
trainer pulls every metric of the step to the host in one `device_get`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _stats(name: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """mean / max / min of `x` over `mask` (0 for all three when nothing is valid)."""
    mask = mask.astype(bool)
    count = jnp.sum(mask)
    x = x.astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1)
    hi = jnp.max(jnp.where(mask, x, -jnp.inf))
    lo = jnp.min(jnp.where(mask, x, jnp.inf))
    return {
        f"{name}/mean": mean,
        f"{name}/max": jnp.where(count > 0, hi, 0.0),
        f"{name}/min": jnp.where(count > 0, lo, 0.0),
    }


def _masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
    count = jnp.maximum(jnp.sum(mask), 1)
    mean = jnp.sum(x * mask) / count
    return jnp.sum(((x - mean) ** 2) * mask) / count


def compute_data_metrics(batch, use_critic: bool) -> dict[str, jax.Array]:
    """Score, reward, advantage, return, value and length statistics of one step's batch.

    Args:
      batch: an `RLBatch` with `prompts` B×P (left padded), `responses` B×R, `response_mask` B×R,
        `attention_mask` B×(P+R), `token_level_scores`, `token_level_rewards`, `advantages`,
        `returns` (B×R float32) and, with a critic, `values`.
      use_critic: add `critic/values/*` and `critic/vf_explained_var`
        (1 − Var[returns − values] / (Var[returns] + 1e-5), over valid tokens).
    Returns:
      float32 scalars keyed `critic/score/*`, `critic/rewards/*`, `critic/advantages/*`,
      `critic/returns/*`, `response_length/{mean,max,min,clip_ratio}`, `prompt_length/*`.
    """
    mask = batch.response_mask.astype(jnp.float32)
    rows = jnp.ones(mask.shape[0], bool)
    prompt_len = batch.prompts.shape[1]
    prompt_lengths = jnp.sum(batch.attention_mask[:, :prompt_len], axis=-1)
    response_lengths = jnp.sum(mask, axis=-1)
    out: dict[str, Any] = {}
    out |= _stats("critic/score", jnp.sum(batch.token_level_scores * mask, -1), rows)
    out |= _stats("critic/rewards", jnp.sum(batch.token_level_rewards * mask, -1), rows)
    out |= _stats("critic/advantages", batch.advantages, mask)
    out |= _stats("critic/returns", batch.returns, mask)
    if use_critic:
        out |= _stats("critic/values", batch.values, mask)
        residual = _masked_var(batch.returns - batch.values, mask)
        out["critic/vf_explained_var"] = 1.0 - residual / (_masked_var(batch.returns, mask) + 1e-5)
    out |= _stats("response_length", response_lengths, rows)
    out["response_length/clip_ratio"] = jnp.mean(response_lengths == mask.shape[1])
    out |= _stats("prompt_length", prompt_lengths, rows)
    out["prompt_length/clip_ratio"] = jnp.mean(prompt_lengths == prompt_len)
    return {k: v.astype(jnp.float32) for k, v in out.items()}
