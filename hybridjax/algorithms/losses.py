"""Policy losses (a registry), the actor loss, and the clipped value loss.

Every policy loss is called as::

    pg_loss, metrics = policy_loss_fn(
        old_log_prob_BxT, log_prob_BxT, advantages_BxT, response_mask_BxT,
        config=actor_loss_config, counts=loss_counts(mini_batch_mask),
        rollout_is_weights_BxT=None)

* log-probs are log π(token) of the sampled tokens (bfloat16 is upcast; losses are float32);
  `log_prob_BxT` carries the gradient.
* `counts` (`loss_agg.LossCounts`) are the whole mini-batch's denominators; None means these rows
  are the whole mini-batch. The loss and **every metric** are this micro-batch's additive share:
  sum them over the micro-batches of a mini-batch to get the mini-batch values (so the summed
  gradient equals the full mini-batch gradient exactly).
* metrics: `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`, `actor/ppo_kl` (float32 scalars).
* `rollout_is_weights_BxT`: truncated importance weights from `rollout_correction`; they
  multiply the per-token loss (no gradient flows through them).

Adding a loss: one function with this signature, decorated `@register_policy_loss("name")`,
selected with `actor.policy_loss.loss_mode=name`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjax.algorithms.config import ActorLossConfig
from hybridjax.algorithms.distillation import (
    DistillationConfig,
    distillation_loss_per_token,
    top_k_forward_kl,
)
from hybridjax.algorithms.kl import kl_penalty
from hybridjax.algorithms.loss_agg import LossCounts, agg_loss, token_mean
from hybridjax.algorithms.masked import masked_count, masked_sum, safe_divide
from hybridjax.algorithms.registry import POLICY_LOSSES

LOG_RATIO_CLAMP = 20.0  # |log π − log π_old| bound before exp, as verl
GSPO_LOG_RATIO_MAX = 10.0

PolicyLossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
register_policy_loss = POLICY_LOSSES.register
get_policy_loss_fn = POLICY_LOSSES.get


def _float32(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Losses are computed in float32 whatever the dtype of the log-probs (e.g. bfloat16)."""
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def _apply_is_weights(losses_BxT: jax.Array, rollout_is_weights_BxT: jax.Array | None) -> jax.Array:
    if rollout_is_weights_BxT is None:
        return losses_BxT
    return losses_BxT * jax.lax.stop_gradient(rollout_is_weights_BxT)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob_BxT: jax.Array,
    log_prob_BxT: jax.Array,
    advantages_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    config: ActorLossConfig,
    counts: LossCounts | None = None,
    rollout_is_weights_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate (arXiv:1707.06347) with dual clip (Ye et al. 2019, arXiv:1912.09729).

    r = exp(clip(logp − old_logp, ±20)); L = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)); for A < 0
    also L = min(L, −A·c). `pg_clipfrac`: share of tokens where the clipped term wins;
    `pg_clipfrac_lower`: share where the dual clip applies; `ppo_kl`: mean(old_logp − logp).
    Aggregated with `config.loss_agg_mode`. Source: verl `compute_policy_loss_vanilla`.
    """
    old_log_prob_BxT, log_prob_BxT, advantages_BxT = _float32(
        old_log_prob_BxT, log_prob_BxT, advantages_BxT
    )
    log_ratio_BxT = jnp.clip(log_prob_BxT - old_log_prob_BxT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_BxT = jnp.exp(log_ratio_BxT)
    losses1_BxT = -advantages_BxT * ratio_BxT
    clipped_ratio_BxT = jnp.clip(
        ratio_BxT, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    )
    losses2_BxT = -advantages_BxT * clipped_ratio_BxT
    clip_losses1_BxT = jnp.maximum(losses1_BxT, losses2_BxT)
    losses3_BxT = -advantages_BxT * config.clip_ratio_c
    negative_BxT = advantages_BxT < 0
    pg_losses_BxT = jnp.where(
        negative_BxT, jnp.minimum(losses3_BxT, clip_losses1_BxT), clip_losses1_BxT
    )
    pg_losses_BxT = _apply_is_weights(pg_losses_BxT, rollout_is_weights_BxT)
    pg_loss = agg_loss(
        pg_losses_BxT, response_mask_BxT, config.loss_agg_mode, counts, config.loss_scale_factor
    )
    metrics = {
        "actor/pg_clipfrac": token_mean(losses2_BxT > losses1_BxT, response_mask_BxT, counts),
        "actor/pg_clipfrac_lower": token_mean(
            (clip_losses1_BxT > losses3_BxT) & negative_BxT, response_mask_BxT, counts
        ),
        "actor/ppo_kl": token_mean(-log_ratio_BxT, response_mask_BxT, counts),
    }
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob_BxT: jax.Array,
    log_prob_BxT: jax.Array,
    advantages_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    config: ActorLossConfig,
    counts: LossCounts | None = None,
    rollout_is_weights_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one importance ratio per sequence.

    log s_i = mean over valid tokens of (logp − old_logp); the token ratio is
    exp(min(sg[log s_i] + logp − sg[logp], 10)) (value s_i, gradient of each token's logp), then
    the PPO clip with ε_low/ε_high. Always aggregated `seq-mean-token-mean`, as the paper and
    verl (`actor.loss_agg_mode` is ignored). `pg_clipfrac_lower` is 0 (no dual clip).
    """
    old_log_prob_BxT, log_prob_BxT, advantages_BxT = _float32(
        old_log_prob_BxT, log_prob_BxT, advantages_BxT
    )
    mask_BxT = response_mask_BxT.astype(jnp.float32)
    log_ratio_BxT = log_prob_BxT - old_log_prob_BxT
    seq_log_ratio_B = safe_divide(
        masked_sum(log_ratio_BxT, mask_BxT, axis=-1), masked_count(mask_BxT, axis=-1)
    )
    token_log_ratio_BxT = (
        jax.lax.stop_gradient(seq_log_ratio_B)[:, None]
        + log_prob_BxT
        - jax.lax.stop_gradient(log_prob_BxT)
    )
    ratio_BxT = jnp.exp(jnp.minimum(token_log_ratio_BxT, GSPO_LOG_RATIO_MAX))
    losses1_BxT = -advantages_BxT * ratio_BxT
    clipped_ratio_BxT = jnp.clip(
        ratio_BxT, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    )
    losses2_BxT = -advantages_BxT * clipped_ratio_BxT
    pg_losses_BxT = _apply_is_weights(jnp.maximum(losses1_BxT, losses2_BxT), rollout_is_weights_BxT)
    pg_loss = agg_loss(pg_losses_BxT, mask_BxT, "seq-mean-token-mean", counts)
    metrics = {
        "actor/pg_clipfrac": token_mean(losses2_BxT > losses1_BxT, mask_BxT, counts),
        "actor/pg_clipfrac_lower": jnp.zeros((), jnp.float32),
        "actor/ppo_kl": token_mean(-log_ratio_BxT, mask_BxT, counts),
    }
    return pg_loss, metrics


def compute_actor_loss(
    old_log_prob_BxT: jax.Array,
    log_prob_BxT: jax.Array,
    advantages_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    config: ActorLossConfig,
    counts: LossCounts | None = None,
    entropy_BxT: jax.Array | None = None,
    ref_log_prob_BxT: jax.Array | None = None,
    rollout_is_weights_BxT: jax.Array | None = None,
    teacher_log_prob_BxT: jax.Array | None = None,
    distillation: DistillationConfig | None = None,
    topk_log_prob_BxTxK: jax.Array | None = None,
    teacher_topk_log_prob_BxTxK: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The actor's loss: policy loss − entropy_coeff·entropy + kl_loss_coef·KL(π‖π_ref)
    (+ distillation_loss_coef·KL(π‖π_teacher) with a direct distillation loss, `distillation`
    with `loss_mode` k1/k3 and `teacher_log_prob_BxT`; with `forward_kl_topk` the truncated
    forward KL `top_k_forward_kl` of `topk_log_prob_BxTxK` (log π_θ at the teacher's top-k ids)
    against `teacher_topk_log_prob_BxTxK`; `hybridjax.algorithms.distillation`).

    The policy loss is `config.loss_mode` from the registry; entropy and the KL loss (estimator
    `config.kl_loss_type`) are aggregated with `config.loss_agg_mode`. Needs `entropy_BxT`
    (e.g. `entropy_from_logits`) when `entropy_coeff != 0` and `ref_log_prob_BxT` when
    `use_kl_loss`; raises ValueError otherwise. Metrics (additive shares, see module docstring):
    `actor/pg_loss`, the policy loss's metrics, `actor/entropy` and `actor/kl_loss` when computed.
    `actor/kl_coef` is the constant `config.kl_loss_coef`; log it from the config.
    """
    pg_loss, metrics = get_policy_loss_fn(config.loss_mode)(
        old_log_prob_BxT,
        log_prob_BxT,
        advantages_BxT,
        response_mask_BxT,
        config=config,
        counts=counts,
        rollout_is_weights_BxT=rollout_is_weights_BxT,
    )
    metrics = {"actor/pg_loss": pg_loss, **metrics}
    loss = pg_loss

    def aggregate(values_BxT):
        return agg_loss(
            values_BxT, response_mask_BxT, config.loss_agg_mode, counts, config.loss_scale_factor
        )

    if config.entropy_coeff != 0 and entropy_BxT is None:
        raise ValueError("actor.entropy_coeff != 0 needs entropy_BxT")
    if entropy_BxT is not None:
        entropy = aggregate(entropy_BxT)
        metrics["actor/entropy"] = jax.lax.stop_gradient(entropy)
        loss = loss - config.entropy_coeff * entropy
    if config.use_kl_loss:
        if ref_log_prob_BxT is None:
            raise ValueError("actor.use_kl_loss needs ref_log_prob_BxT")
        log_prob32_BxT, ref_log_prob32_BxT = _float32(log_prob_BxT, ref_log_prob_BxT)
        kl_BxT = kl_penalty(log_prob32_BxT, ref_log_prob32_BxT, config.kl_loss_type)
        kl_loss = aggregate(kl_BxT)
        metrics["actor/kl_loss"] = kl_loss
        loss = loss + config.kl_loss_coef * kl_loss
    if distillation is not None and distillation.as_loss:
        if teacher_log_prob_BxT is None:
            raise ValueError("a distillation loss needs teacher_log_prob_BxT")
        log_prob32_BxT, teacher32_BxT = _float32(log_prob_BxT, teacher_log_prob_BxT)
        if distillation.loss_mode == "forward_kl_topk":
            if topk_log_prob_BxTxK is None or teacher_topk_log_prob_BxTxK is None:
                raise ValueError("loss_mode forward_kl_topk needs both top-k log-prob arrays")
            per_token = top_k_forward_kl(topk_log_prob_BxTxK, teacher_topk_log_prob_BxTxK)
        else:
            per_token = distillation_loss_per_token(
                log_prob32_BxT, teacher32_BxT, distillation.loss_mode
            )
        distill_loss = aggregate(per_token)
        metrics["actor/distillation_loss"] = distill_loss
        metrics["distill/reverse_kl"] = aggregate(log_prob32_BxT - teacher32_BxT)
        loss = loss + distillation.distillation_loss_coef * distill_loss
    metrics = {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}
    return loss, metrics


def compute_value_loss(
    vpreds_BxT: jax.Array,
    returns_BxT: jax.Array,
    values_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    counts: LossCounts | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss ½·max((v − R)², (clip(v, v_old ± ε_v) − R)²), aggregated like the
    policy loss (PPO2 / TRL; verl `compute_value_loss`).

    `vpreds_BxT` carries the gradient; `values_BxT` are the critic's values at rollout time;
    `returns_BxT` the estimator's returns. Metrics (additive shares): `critic/vf_loss`,
    `critic/vf_clipfrac` (share of tokens where the clipped term is larger), `critic/vpred_mean`.
    """
    vpreds_BxT, returns_BxT, values_BxT = _float32(vpreds_BxT, returns_BxT, values_BxT)
    vpred_clipped_BxT = jnp.clip(
        vpreds_BxT, values_BxT - cliprange_value, values_BxT + cliprange_value
    )
    losses1_BxT = jnp.square(vpreds_BxT - returns_BxT)
    losses2_BxT = jnp.square(vpred_clipped_BxT - returns_BxT)
    vf_loss = 0.5 * agg_loss(
        jnp.maximum(losses1_BxT, losses2_BxT),
        response_mask_BxT,
        loss_agg_mode,
        counts,
        loss_scale_factor,
    )
    metrics = {
        "critic/vf_loss": vf_loss,
        "critic/vf_clipfrac": token_mean(losses2_BxT > losses1_BxT, response_mask_BxT, counts),
        "critic/vpred_mean": token_mean(vpreds_BxT, response_mask_BxT, counts),
    }
    return vf_loss, {name: jax.lax.stop_gradient(value) for name, value in metrics.items()}
