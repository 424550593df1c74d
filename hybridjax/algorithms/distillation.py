"""On-policy distillation: the student (the actor) samples, a frozen teacher scores the sampled
tokens, and the student minimises the per-token reverse KL KL(π_student ‖ π_teacher).

With log-probs of the sampled token y_t under each model, the single-sample estimate of the
reverse KL at position t is k1 = log π_student(y_t) − log π_teacher(y_t) (its expectation over
y_t ~ π_student is the exact reverse KL). Two ways to minimise it (`distillation.loss_mode`):

* `reward` (Thinking Machines' "On-policy distillation", 2025; TRL GKD with lmbda = 1, beta = 1):
  the per-token advantage −coef · k1_t (discount 0: each token is credited with its own KL,
  not with the KL that follows it), added to the task advantage of the registered estimator
  (`use_policy_loss`) or replacing it. k1 uses π_old, so the term is a constant of the update
  and goes through the PPO/GRPO policy loss like any advantage.
* `k1` / `k3` (verl's `actor_rollout_ref.distillation.loss_mode`): a direct loss term
  coef · agg(k(π_θ, π_teacher)) on the sampled tokens, differentiated through π_θ, aggregated
  with `actor.loss_agg_mode`; k3 = e^(−x) + x − 1 is the low-variance estimator of
  `hybridjax.algorithms.kl`. Without `use_policy_loss` the task advantage is 0, so the policy
  loss adds nothing and this is pure distillation.
* `forward_kl_topk` (with `distillation.topk` = k ≥ 1): a direct loss over the teacher's k most
  likely tokens at each response position (stored by the teacher pass, B×R×k, instead of its
  full distribution), the forward KL truncated to them,
  L_t = Σ_{v ∈ top-k of π_teacher} π_teacher(v) (log π_teacher(v) − log π_θ(v)),
  not renormalised: with k = V it is the exact KL(π_teacher ‖ π_θ), and for k < V its minimum
  over π_θ puts π_teacher(v) / Σ_{top-k} π_teacher on each kept token. It scores the whole
  next-token distribution at each state the student visited rather than the one sampled
  token (Agarwal et al. 2024, GKD, β = 0 with the student's samples, λ = 1; verl's top-k
  distillation loss KL(P_topk ‖ Q) with the teacher's top-k log-probs and indices). The
  truncated reverse KL Σ_{top-k} π_θ (log π_θ − log π_teacher) is not used: below k = V it
  is minimised by moving π_θ's mass off the kept tokens.

Metric: `distill/reverse_kl`, the token mean of k1 over `response_mask`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from hybridjax.algorithms.kl import kl_penalty
from hybridjax.algorithms.masked import masked_mean

DISTILLATION_LOSS_MODES = ("reward", "k1", "k3", "forward_kl_topk")


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
    """`actor_rollout_ref.distillation.*` for the jitted stages (hashable, static).

    Attributes:
      enabled: a teacher scores the rollouts (the `teacher` stage runs).
      loss_mode: `reward` (per-token advantage) or `k1` / `k3` (direct loss); see the module
        docstring.
      distillation_loss_coef: weight of the distillation advantage or loss term (≥ 0).
      use_policy_loss: keep the task reward's advantage beside the distillation term (False:
        pure distillation, the task advantage is 0).
      topk: teacher tokens stored per response position for `forward_kl_topk` (0: none).
      vocab_limit: the student's vocabulary size: the teacher's top-k ids stay below it (a
        teacher's vocabulary may be padded beyond the student's); 0: any id.
    """

    enabled: bool = False
    loss_mode: str = "reward"
    distillation_loss_coef: float = 1.0
    use_policy_loss: bool = False
    topk: int = 0
    vocab_limit: int = 0

    def __post_init__(self) -> None:
        if self.loss_mode not in DISTILLATION_LOSS_MODES:
            raise ValueError(
                f"actor_rollout_ref.distillation.loss_mode: {self.loss_mode!r} is not one of "
                f"{DISTILLATION_LOSS_MODES}"
            )
        if (self.loss_mode == "forward_kl_topk") != (self.topk > 0):
            raise ValueError(
                "actor_rollout_ref.distillation.topk must be >= 1 exactly when loss_mode is "
                f"'forward_kl_topk' (got topk={self.topk}, loss_mode={self.loss_mode!r})"
            )

    @property
    def with_topk(self) -> bool:
        """The teacher pass stores its top-k log-probs and ids (`forward_kl_topk`)."""
        return self.enabled and self.topk > 0

    @property
    def as_reward(self) -> bool:
        """The distillation term is an advantage (reads π_old in the adv stage)."""
        return self.enabled and self.loss_mode == "reward"

    @property
    def as_loss(self) -> bool:
        """The distillation term is a loss of the actor update."""
        return self.enabled and self.loss_mode != "reward"

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> DistillationConfig:
        """From the `actor_rollout_ref.distillation` section:
        `actor_rollout_ref.distillation.enabled`, `actor_rollout_ref.distillation.loss_mode`,
        `actor_rollout_ref.distillation.distillation_loss_coef`,
        `actor_rollout_ref.distillation.use_policy_loss`,
        `actor_rollout_ref.distillation.topk` (the teacher's model keys are
        `hybridjax.training.build.build_teacher`'s)."""
        return cls(
            enabled=bool(section["enabled"]),
            loss_mode=str(section["loss_mode"]),
            distillation_loss_coef=float(section["distillation_loss_coef"]),
            use_policy_loss=bool(section["use_policy_loss"]),
            topk=int(section["topk"]),
        )


def reverse_kl_per_token(
    student_log_prob_BxT: jax.Array, teacher_log_prob_BxT: jax.Array, response_mask_BxT: jax.Array
) -> jax.Array:
    """k1_t = (log π_student(y_t) − log π_teacher(y_t)) · mask, B×T float32 (nats)."""
    return (student_log_prob_BxT - teacher_log_prob_BxT) * response_mask_BxT


def distillation_advantages(
    advantages_BxT: jax.Array,
    student_log_prob_BxT: jax.Array,
    teacher_log_prob_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    config: DistillationConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The advantages the actor update uses, with distillation.

    A = (A_task if `use_policy_loss` else 0) + (−coef · k1 if `loss_mode` is `reward`), masked;
    k1 from `reverse_kl_per_token` (student = π_old). All B×T float32.
    Returns (advantages, {`distill/reverse_kl`: token mean of k1}).
    Source: Thinking Machines, "On-policy distillation" (2025): per-token advantage = −reverse KL.
    """
    k1_BxT = reverse_kl_per_token(student_log_prob_BxT, teacher_log_prob_BxT, response_mask_BxT)
    out = advantages_BxT if config.use_policy_loss else jnp.zeros_like(advantages_BxT)
    if config.as_reward:
        out = out - config.distillation_loss_coef * k1_BxT
    metrics = {"distill/reverse_kl": masked_mean(k1_BxT, response_mask_BxT)}
    return out * response_mask_BxT, metrics


def distillation_loss_per_token(
    log_prob_BxT: jax.Array, teacher_log_prob_BxT: jax.Array, loss_mode: str
) -> jax.Array:
    """The direct loss per sampled token, B×T float32: `k1` = log π_θ − log π_teacher, `k3` =
    e^(−x) + x − 1 with x = log π_θ − log π_teacher (clamped as verl's low_var_kl). The
    gradient flows through `log_prob_BxT` only (the teacher is frozen).
    Source: verl `actor_rollout_ref.distillation.loss_mode` (k1, k3); J. Schulman, "Approximating
    KL divergence". Raises ValueError for another mode."""
    if loss_mode not in ("k1", "k3"):
        raise ValueError(f"distillation loss_mode {loss_mode!r}: a direct loss is 'k1' or 'k3'")
    return kl_penalty(log_prob_BxT, jax.lax.stop_gradient(teacher_log_prob_BxT), loss_mode)


def top_k_forward_kl(log_prob_BxTxK: jax.Array, teacher_log_prob_BxTxK: jax.Array) -> jax.Array:
    """L_t = Σ_j π_teacher(v_j) (log π_teacher(v_j) − log π_θ(v_j)) over the teacher's top-k
    tokens v_j of each position, B×T float32 (nats): the `forward_kl_topk` loss (see the
    module docstring; not renormalised, so k = V gives the exact KL(π_teacher ‖ π_θ)).

    Args:
      log_prob_BxTxK: log π_θ at the teacher's top-k ids (`hybridjax.models.logprobs.
        log_probs_at`); the gradient flows through it only.
      teacher_log_prob_BxTxK: the teacher's log-probs of those ids (`top_k_log_probs`).
    Source: Agarwal et al. 2024 (GKD), forward KL on the student's samples; verl's top-k
    distillation loss KL(P_topk ‖ Q).
    """
    teacher = jax.lax.stop_gradient(teacher_log_prob_BxTxK.astype(jnp.float32))
    student = log_prob_BxTxK.astype(jnp.float32)
    return jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
