"""Advantage estimators: one registry, one signature.

Every estimator is called as::

    advantages_BxT, returns_BxT = estimator(
        token_level_rewards_BxT, response_mask_BxT,
        values_BxT=..., reward_baselines_B=..., uid_B=..., config=algorithm_config)

* `token_level_rewards_BxT` float32: the reward of each response token (KL penalty already
  applied when `algorithm.use_kl_in_reward`); outcome estimators use the per-row sum over valid
  tokens as the response's score.
* `response_mask_BxT` 0/1: valid response tokens. Rows may have no valid token at all.
* `values_BxT` (critic values, `gae` only) and `reward_baselines_B` (greedy-rollout scores,
  `remax` only) are None when the stage that fills them did not run; an estimator that needs one
  raises ValueError naming it (at trace time: no host sync).
* `uid_B` int (B,): the group of each row (verl's `index`, the prompt's uid). Rows with equal
  uid form a group, of any size and in any row order; group statistics are segmented sums
  (`group_sums`: static shapes however many rows a stage dropped, bitwise reproducible).
  Estimators without groups ignore it.
* `config`: the frozen `AlgorithmConfig` (`gamma`, `lam`, `norm_adv_by_std_in_grpo`, ...).

Both outputs are 0 outside the response mask. Shapes are static; every estimator is jittable
(pass `config` as a static / closed-over value).

Adding an estimator: write one function with this signature in any module, decorate it with
`@register_adv_est("name")`, add a test, select it with `algorithm.adv_estimator=name`. An
estimator that reads `reward_baselines_B` says so with `fn.needs_reward_baseline = True`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjax.algorithms.config import AlgorithmConfig
from hybridjax.algorithms.masked import masked_sum, masked_whiten
from hybridjax.algorithms.registry import ADV_ESTIMATORS

GRPO_EPS = 1e-6  # added to the group std, as verl

AdvantageEstimator = Callable[..., tuple[jax.Array, jax.Array]]
register_adv_est = ADV_ESTIMATORS.register
get_adv_estimator_fn = ADV_ESTIMATORS.get


def compute_advantage(
    token_level_rewards_BxT: jax.Array,
    response_mask_BxT: jax.Array,
    *,
    config: AlgorithmConfig,
    uid_B: jax.Array | None = None,
    values_BxT: jax.Array | None = None,
    reward_baselines_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the estimator named by `config.adv_estimator`; returns (advantages, returns), B×T."""
    estimator = get_adv_estimator_fn(config.adv_estimator)
    return estimator(
        token_level_rewards_BxT,
        response_mask_BxT,
        values_BxT=values_BxT,
        reward_baselines_B=reward_baselines_B,
        uid_B=uid_B,
        config=config,
    )


def needs_reward_baseline(name: str) -> bool:
    """Whether estimator `name` reads `reward_baselines_B` (it was registered with the attribute
    `needs_reward_baseline = True`): the trainer then scores a greedy rollout of each prompt."""
    return getattr(get_adv_estimator_fn(name), "needs_reward_baseline", False)


def _require(value: jax.Array | None, name: str, estimator: str) -> jax.Array:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name}, which is missing")
    return value


def group_sums(x_B: jax.Array, uid_B: jax.Array) -> jax.Array:
    """Σ x over the row's group (rows sharing a uid), for every row: (B,), x's dtype.

    A segmented sum with static shapes: the rows are sorted by uid (stable), summed by a
    segmented `associative_scan` that restarts at each new uid, and each row takes its
    segment's total. Unlike `jax.ops.segment_sum` (a scatter-add, which GPUs run with atomics in
    no fixed order) the order of additions is fixed, so results are bitwise reproducible on
    every backend, as the resumed-run guarantee needs. O(B log B) on B numbers.
    """
    (batch,) = x_B.shape
    order_B = jnp.argsort(uid_B, stable=True)
    uid_sorted_B = uid_B[order_B]
    new_B = jnp.concatenate([jnp.ones(1, bool), uid_sorted_B[1:] != uid_sorted_B[:-1]])

    def add(left, right):
        (left_sum, left_new), (right_sum, right_new) = left, right
        return jnp.where(right_new, right_sum, left_sum + right_sum), left_new | right_new

    running_B, _ = jax.lax.associative_scan(add, (x_B[order_B], new_B))
    last_B = jnp.concatenate([new_B[1:], jnp.ones(1, bool)])
    end_B = jax.lax.cummin(jnp.where(last_B, jnp.arange(batch), batch), reverse=True)
    return jnp.zeros_like(x_B).at[order_B].set(running_B[end_B], unique_indices=True)


def group_mean_std(scores_B: jax.Array, uid_B: jax.Array) -> tuple[jax.Array, ...]:
    """Per-row statistics of the row's group: (mean_B, unbiased std_B, size_B), float32.

    Groups are the rows sharing a uid (`uid_B` int32, any values); sums are `group_sums`, so
    shapes are static for any grouping. A singleton group has std 0 (numpy's ddof=1 gives
    NaN; callers follow verl's singleton rules).
    """
    size_B = group_sums(jnp.ones_like(scores_B), uid_B)
    mean_B = group_sums(scores_B, uid_B) / size_B
    squares_B = group_sums(jnp.square(scores_B - mean_B), uid_B)
    std_B = jnp.sqrt(squares_B / jnp.maximum(size_B - 1.0, 1.0))
    return mean_B, std_B, size_B


def response_scores(token_level_rewards_BxT: jax.Array, response_mask_BxT: jax.Array) -> jax.Array:
    """Per-response score (B,): the sum of token rewards over valid tokens."""
    return masked_sum(token_level_rewards_BxT, response_mask_BxT, axis=-1)


def _broadcast(advantage_B: jax.Array, response_mask_BxT: jax.Array) -> jax.Array:
    return advantage_B[:, None] * response_mask_BxT.astype(advantage_B.dtype)


def discounted_returns(
    token_level_rewards_BxT: jax.Array, response_mask_BxT: jax.Array, gamma: float
) -> jax.Array:
    """Return-to-go G_t = r_t + γ·G_next, walking backwards over valid tokens only (B×T).

    Masked positions are skipped (they neither add reward nor discount) and come back as 0.
    verl's REINFORCE++ resets the running return at every masked position instead; the two
    agree on right-padded responses and differ only for masks with holes (multi-turn).
    """
    mask_TxB = response_mask_BxT.T.astype(jnp.float32)
    rewards_TxB = jnp.where(mask_TxB > 0, token_level_rewards_BxT.T, 0.0)

    def step(running_B, inputs):
        reward_B, mask_B = inputs
        running_B = jnp.where(mask_B > 0, reward_B + gamma * running_B, running_B)
        return running_B, running_B * mask_B

    _, returns_TxB = jax.lax.scan(
        step, jnp.zeros(rewards_TxB.shape[1], jnp.float32), (rewards_TxB, mask_TxB), reverse=True
    )
    return returns_TxB.T


@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards_BxT, response_mask_BxT, *, values_BxT, config, **_
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438).

    δ_t = r_t + γ·V_next − V_t and A_t = δ_t + γλ·A_next, walking backwards over valid tokens
    only: a masked position neither bootstraps its value nor breaks the chain (verl's
    `compute_gae_advantage_return`). returns = A + V (before whitening); advantages are whitened
    over all valid tokens of the batch. Needs `values_BxT`.
    """
    values_BxT = _require(values_BxT, "values_BxT", "gae")
    gamma, lam = config.gamma, config.lam
    mask_TxB = response_mask_BxT.T.astype(jnp.float32)
    rewards_TxB = jnp.where(mask_TxB > 0, token_level_rewards_BxT.T, 0.0)
    values_TxB = jnp.where(mask_TxB > 0, values_BxT.T, 0.0)

    def step(carry, inputs):
        next_value_B, last_gae_B = carry
        reward_B, value_B, mask_B = inputs
        delta_B = reward_B + gamma * next_value_B - value_B
        gae_B = delta_B + gamma * lam * last_gae_B
        valid_B = mask_B > 0
        next_value_B = jnp.where(valid_B, value_B, next_value_B)
        last_gae_B = jnp.where(valid_B, gae_B, last_gae_B)
        return (next_value_B, last_gae_B), gae_B * mask_B

    zeros_B = jnp.zeros(rewards_TxB.shape[1], jnp.float32)
    _carry, advantages_TxB = jax.lax.scan(
        step, (zeros_B, zeros_B), (rewards_TxB, values_TxB, mask_TxB), reverse=True
    )
    advantages_BxT = advantages_TxB.T
    returns_BxT = (advantages_BxT + values_TxB.T) * mask_TxB.T
    return masked_whiten(advantages_BxT, response_mask_BxT), returns_BxT


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards_BxT, response_mask_BxT, *, uid_B, config, **_
) -> tuple[jax.Array, jax.Array]:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A = (s − mean_group) / (std_group + 1e-6).

    std is the unbiased (n−1) standard deviation of the row's uid group. With
    `norm_adv_by_std_in_grpo=False` the division is skipped (Dr.GRPO, arXiv:2503.20783). A
    singleton group uses mean 0, std 1, as verl. An all-equal group gives 0 everywhere.
    Returns = advantages. Source: verl `compute_grpo_outcome_advantage` (`index` = uid).
    Example: scores [1, 0, 0, 0] with uids [a, b, a, b] give [0.707, 0, −0.707, 0].
    """
    uid_B = _require(uid_B, "uid_B", "grpo")
    scores_B = response_scores(token_level_rewards_BxT, response_mask_BxT)
    mean_B, std_B, size_B = group_mean_std(scores_B, uid_B)
    single_B = size_B == 1
    advantage_B = scores_B - jnp.where(single_B, 0.0, mean_B)
    if config.norm_adv_by_std_in_grpo:
        advantage_B = advantage_B / (jnp.where(single_B, 1.0, std_B) + GRPO_EPS)
    advantages_BxT = _broadcast(advantage_B, response_mask_BxT)
    return advantages_BxT, advantages_BxT


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards_BxT, response_mask_BxT, *, uid_B, **_
) -> tuple[jax.Array, jax.Array]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = s_i − mean_{j≠i} s_j over the row's
    uid group of size n.

    Computed as n/(n−1)·(s_i − mean_group). A singleton group keeps its raw score. Returns =
    advantages. Source: verl `compute_rloo_outcome_advantage`.
    """
    uid_B = _require(uid_B, "uid_B", "rloo")
    scores_B = response_scores(token_level_rewards_BxT, response_mask_BxT)
    mean_B, _std_B, size_B = group_mean_std(scores_B, uid_B)
    loo_B = (scores_B - mean_B) * size_B / jnp.maximum(size_B - 1.0, 1.0)
    advantage_B = jnp.where(size_B > 1, loo_B, scores_B)
    advantages_BxT = _broadcast(advantage_B, response_mask_BxT)
    return advantages_BxT, advantages_BxT


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards_BxT, response_mask_BxT, *, config, **_
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): γ-discounted return-to-go, whitened over the
    valid tokens of the batch. Returns are the un-whitened returns-to-go.
    """
    returns_BxT = discounted_returns(token_level_rewards_BxT, response_mask_BxT, config.gamma)
    return masked_whiten(returns_BxT, response_mask_BxT), returns_BxT


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards_BxT, response_mask_BxT, *, uid_B, **_
) -> tuple[jax.Array, jax.Array]:
    """REINFORCE++-baseline (arXiv:2501.03262): s − mean of the row's uid group, broadcast over
    the response, then whitened over the valid tokens of the batch. A singleton group uses
    mean 0 (verl). Returns = advantages.
    """
    uid_B = _require(uid_B, "uid_B", "reinforce_plus_plus_baseline")
    scores_B = response_scores(token_level_rewards_BxT, response_mask_BxT)
    mean_B, _std_B, size_B = group_mean_std(scores_B, uid_B)
    advantages_BxT = _broadcast(scores_B - jnp.where(size_B > 1, mean_B, 0.0), response_mask_BxT)
    advantages_BxT = masked_whiten(advantages_BxT, response_mask_BxT)
    return advantages_BxT, advantages_BxT


@register_adv_est("remax")
def compute_remax_outcome_advantage(
    token_level_rewards_BxT, response_mask_BxT, *, reward_baselines_B, **_
) -> tuple[jax.Array, jax.Array]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): A_t = G_t − b, with G_t the undiscounted
    return-to-go and b the score of a greedy rollout of the same prompt (`reward_baselines_B`).
    Returns are G_t.
    """
    baselines_B = _require(reward_baselines_B, "reward_baselines_B", "remax")
    returns_BxT = discounted_returns(token_level_rewards_BxT, response_mask_BxT, 1.0)
    advantages_BxT = returns_BxT - _broadcast(baselines_B, response_mask_BxT)
    return advantages_BxT, returns_BxT


compute_remax_outcome_advantage.needs_reward_baseline = True
