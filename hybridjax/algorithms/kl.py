"""KL estimators, KL in the reward, and the fixed / adaptive KL controllers.

Estimators (J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html),
with x = logp − ref_logp per token:

* `kl` / `k1`: x
* `abs`: |x|
* `mse` / `k2`: ½x²
* `low_var_kl` / `k3`: e^(−x) + x − 1, with −x clamped to ±20 and the result to [−10, 10] (verl)
* any name with a `+` suffix (e.g. `k3+`, `low_var_kl+`): straight-through: the forward value of
  the named estimator, the gradient of k2 (whose expected gradient is the true KL gradient).

The KL controller is pure: its state is one float32 scalar (the coefficient), updated by
`update_kl_coef` from the step's measured KL, so it can live in the jitted train state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax.algorithms.config import KLControlConfig, check_kl_penalty_type
from hybridjax.algorithms.masked import masked_count, masked_mean, safe_divide
from hybridjax.algorithms.registry import KL_ESTIMATORS

LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_VALUE_CLAMP = 10.0


def _k1(logp, ref):
    return logp - ref


def _abs(logp, ref):
    return jnp.abs(logp - ref)


def _k2(logp, ref):
    return 0.5 * jnp.square(logp - ref)


def _k3(logp, ref):
    log_ratio = jnp.clip(ref - logp, -LOW_VAR_KL_LOG_RATIO_CLAMP, LOW_VAR_KL_LOG_RATIO_CLAMP)
    kl = jnp.exp(log_ratio) - log_ratio - 1.0
    return jnp.clip(kl, -LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)


for _name, _fn in (
    ("kl", _k1),
    ("k1", _k1),
    ("abs", _abs),
    ("mse", _k2),
    ("k2", _k2),
    ("low_var_kl", _k3),
    ("k3", _k3),
):
    KL_ESTIMATORS.register(_name)(_fn)
KL_PENALTY_TYPES = KL_ESTIMATORS.names() + tuple(name + "+" for name in KL_ESTIMATORS.names())


def kl_penalty(logprob: jax.Array, ref_logprob: jax.Array, kl_penalty: str) -> jax.Array:
    """Per-token KL estimate between the policy and the reference (same shape as the inputs).

    `logprob`, `ref_logprob`: log-probabilities of the sampled tokens (float32, any shape).
    `kl_penalty`: one of `KL_PENALTY_TYPES` (see the module docstring); raises ValueError else.
    Source: verl `kl_penalty` (`verl/trainer/ppo/core_algos.py`).
    """
    check_kl_penalty_type(kl_penalty)
    straight_through = kl_penalty.endswith("+")
    forward = KL_ESTIMATORS.get(kl_penalty.rstrip("+"))(logprob, ref_logprob)
    if not straight_through:
        return forward
    backward = _k2(logprob, ref_logprob)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


def apply_kl_penalty(
    token_level_scores_BxT: jax.Array,
    old_log_probs_BxT: jax.Array,
    ref_log_prob_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    kl_coef: jax.Array | float,
    kl_penalty_type: str = "kl",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL in the reward: r_t = score_t − β·KL_t on valid tokens (Ziegler et al. 2019).

    Returns (token_level_rewards_BxT, metrics) with metrics `actor/reward_kl_penalty` (per-sequence
    mean KL averaged over sequences that have a valid token: the `current_kl` to feed
    `update_kl_coef`) and `actor/reward_kl_penalty_coeff` (β). Source: verl `apply_kl_penalty`
    (which divides by zero on an empty response; here such rows are left out of the mean).
    """
    mask_BxT = response_mask_BxT.astype(jnp.float32)
    kl_BxT = kl_penalty(old_log_probs_BxT, ref_log_prob_BxT, kl_penalty_type) * mask_BxT
    rewards_BxT = token_level_scores_BxT - kl_coef * kl_BxT
    seq_kl_B = masked_mean(kl_BxT, mask_BxT, axis=-1)
    has_tokens_B = (masked_count(mask_BxT, axis=-1) > 0).astype(jnp.float32)
    current_kl = safe_divide(jnp.sum(seq_kl_B * has_tokens_B), jnp.sum(has_tokens_B))
    metrics = {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": jnp.asarray(kl_coef, jnp.float32),
    }
    return rewards_BxT, metrics


def update_kl_coef(
    kl_coef: jax.Array | float,
    current_kl: jax.Array | float,
    n_steps: int | jax.Array,
    config: KLControlConfig,
) -> jax.Array:
    """One KL-controller step; returns the new coefficient (float32 scalar).

    `fixed`: unchanged. `adaptive` (Ziegler et al. 2019, arXiv:1909.08593, §2.2):
    β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n_steps/horizon), where n_steps is the number of
    sequences in the batch (verl passes the batch size).
    """
    kl_coef = jnp.asarray(kl_coef, jnp.float32)
    if config.type == "fixed":
        return kl_coef
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / config.target_kl - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + error * n_steps / config.horizon)
