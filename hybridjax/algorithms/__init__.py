"""The RL algorithm core: advantages, policy and value losses, KL, loss aggregation.

Pure `jnp` functions with static shapes and no host syncs; all are jittable. The trainer uses:

* `compute_advantage(token_level_rewards_BxT, response_mask_BxT, config=AlgorithmConfig,
  uid_B=..., values_BxT=..., reward_baselines_B=...) -> (advantages_BxT, returns_BxT)`,
  dispatching on `algorithm.adv_estimator` through the `ADV_ESTIMATORS` registry
  (`gae`, `grpo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `remax`).
  Groups are the rows sharing a uid (any size, any order). See `advantages` for the signature.
* `loss_counts(mini_batch_mask)` once per mini-batch, then per micro-batch
  `compute_actor_loss(...)` / `compute_value_loss(...)` with those counts: losses and metrics
  are additive shares, so summing over micro-batches reproduces the mini-batch exactly
  (`loss_agg`). Policy losses live in the `POLICY_LOSSES` registry (`vanilla`, `gspo`).
* `apply_kl_penalty` + `update_kl_coef` for KL in the reward; `kl_penalty` estimators.
* `compute_rollout_importance_weights` for rollout/trainer mismatch; `apply_overlong_penalty`
  for DAPO length shaping; `entropy_from_logits` (chunked); `masked_mean/var/whiten`.

Configs (`config`) are frozen dataclasses built from verl-named config sections.
"""

from hybridjax.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from hybridjax.algorithms.config import (
    ActorLossConfig,
    AlgorithmConfig,
    CriticLossConfig,
    KLControlConfig,
    OverlongBufferConfig,
)
from hybridjax.algorithms.entropy import entropy_from_logits
from hybridjax.algorithms.kl import (
    KL_PENALTY_TYPES,
    apply_kl_penalty,
    kl_penalty,
    update_kl_coef,
)
from hybridjax.algorithms.loss_agg import LOSS_AGG_MODES, LossCounts, agg_loss, loss_counts
from hybridjax.algorithms.losses import (
    POLICY_LOSSES,
    compute_actor_loss,
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
)
from hybridjax.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridjax.algorithms.overlong import apply_overlong_penalty, overlong_penalty
from hybridjax.algorithms.rollout_correction import (
    compute_rollout_importance_weights,
    rollout_probs_diff_metrics,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ActorLossConfig",
    "AlgorithmConfig",
    "CriticLossConfig",
    "KLControlConfig",
    "LossCounts",
    "OverlongBufferConfig",
    "agg_loss",
    "apply_kl_penalty",
    "apply_overlong_penalty",
    "compute_actor_loss",
    "compute_advantage",
    "compute_rollout_importance_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "kl_penalty",
    "loss_counts",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "register_adv_est",
    "register_policy_loss",
    "rollout_probs_diff_metrics",
    "update_kl_coef",
]
