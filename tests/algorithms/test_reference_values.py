"""Every worked value of docs/verl_behaviour.md that belongs to the algorithm core."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.algorithms import (
    ActorLossConfig,
    AlgorithmConfig,
    KLControlConfig,
    agg_loss,
    apply_overlong_penalty,
    compute_actor_loss,
    compute_advantage,
    compute_rollout_importance_weights,
    compute_value_loss,
    get_policy_loss_fn,
    kl_penalty,
    loss_counts,
    overlong_penalty,
    update_kl_coef,
)

ACTOR = ActorLossConfig(clip_ratio=0.2, clip_ratio_c=3.0)


def outcome_rewards(scores, length=4):
    """Scores on the last token of full-length responses: rewards B×T, mask B×T."""
    rewards = np.zeros((len(scores), length), np.float32)
    rewards[:, -1] = scores
    return jnp.asarray(rewards), jnp.ones((len(scores), length), jnp.float32)


def advantage_of(estimator, scores, group_size, uid=None, **config):
    """Advantages of outcome scores; groups are contiguous blocks of `group_size` unless `uid`."""
    rewards, mask = outcome_rewards(scores)
    config = AlgorithmConfig(adv_estimator=estimator, **config)
    uid = np.arange(len(scores)) // group_size if uid is None else np.asarray(uid)
    advantages, returns = compute_advantage(rewards, mask, config=config, uid_B=jnp.asarray(uid))
    return np.asarray(advantages[:, 0]), np.asarray(returns[:, 0])


# --- advantages --------------------------------------------------------------------------------


def test_grpo_std_normalised():
    advantages, returns = advantage_of("grpo", [1, 0, 0, 0], 4)
    np.testing.assert_allclose(advantages, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
    np.testing.assert_array_equal(advantages, returns)


def test_grpo_groups_by_uid_not_by_position():
    """Rewards [1, 0, 0, 0] with uids [a, b, a, b]: group a = {1, 0}, group b = {0, 0}."""
    advantages, _ = advantage_of("grpo", [1, 0, 0, 0], 2, uid=[0, 1, 0, 1])
    np.testing.assert_allclose(advantages, [0.7071, 0, -0.7071, 0], atol=1e-4)


def test_grpo_without_std_is_dr_grpo():
    advantages, _ = advantage_of("grpo", [1, 0, 0, 0], 4, norm_adv_by_std_in_grpo=False)
    np.testing.assert_allclose(advantages, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)


def test_grpo_all_equal_group_is_zero_not_nan():
    advantages, _ = advantage_of("grpo", [1, 1, 1, 1], 4)
    np.testing.assert_array_equal(advantages, [0, 0, 0, 0])


def test_grpo_singleton_group():
    advantages, _ = advantage_of("grpo", [1.0], 1)
    np.testing.assert_allclose(advantages, [1.0], rtol=1e-5)


def test_rloo():
    advantages, _ = advantage_of("rloo", [1, 0, 0, 0], 4)
    np.testing.assert_allclose(advantages, [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_rloo_singleton_keeps_raw_score():
    advantages, _ = advantage_of("rloo", [0.7], 1)
    np.testing.assert_allclose(advantages, [0.7], rtol=1e-6)


def test_gae_masked_position_never_bootstraps():
    # Valid tokens 0,1 then padding with a huge (garbage) value: it must never be used.
    rewards = jnp.array([[0.0, 1.0, 0.0, 0.0]])
    values = jnp.array([[0.5, 0.25, 100.0, -100.0]])
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    config = AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=1.0)
    _, returns = compute_advantage(rewards, mask, config=config, values_BxT=values)
    # A_1 = 1 − 0.25 = 0.75; A_0 = (0 + 0.25 − 0.5) + 0.75 = 0.5; returns = A + V = [1, 1].
    np.testing.assert_allclose(returns, [[1.0, 1.0, 0.0, 0.0]], rtol=1e-6)


def test_remax_baseline_is_greedy_reward():
    rewards, mask = outcome_rewards([1.0, 0.0], length=2)
    config = AlgorithmConfig(adv_estimator="remax")
    baselines = jnp.array([0.25, 0.5])
    advantages, returns = compute_advantage(
        rewards, mask, config=config, reward_baselines_B=baselines
    )
    np.testing.assert_allclose(advantages, [[0.75, 0.75], [-0.5, -0.5]])
    np.testing.assert_allclose(returns, [[1.0, 1.0], [0.0, 0.0]])


# --- PPO loss ----------------------------------------------------------------------------------


def ppo_token(advantage, ratio):
    """Per-token vanilla loss and its metrics for one token with the given A and ratio."""
    old = jnp.zeros((1, 1))
    new = jnp.log(jnp.array([[ratio]], jnp.float32))
    loss, metrics = get_policy_loss_fn("vanilla")(
        old, new, jnp.array([[advantage]], jnp.float32), jnp.ones((1, 1)), config=ACTOR
    )
    return float(loss), {k: float(v) for k, v in metrics.items()}


def test_ppo_positive_advantage_is_clipped():
    loss, metrics = ppo_token(1.0, 1.5)
    assert loss == pytest.approx(-1.2, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == 1.0 and metrics["actor/pg_clipfrac_lower"] == 0.0


def test_ppo_negative_advantage_low_ratio():
    loss, _ = ppo_token(-1.0, 0.5)
    assert loss == pytest.approx(0.8, rel=1e-6)


def test_ppo_dual_clip():
    loss, metrics = ppo_token(-1.0, 5.0)
    assert loss == pytest.approx(3.0, rel=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == 1.0


def test_ratio_log_clamped_at_20():
    # ppo_kl = mean(old − new) sees the clamped log-ratio: −20, not −30.
    _, metrics = ppo_token(1.0, math.exp(30.0))
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)


def test_first_on_policy_minibatch():
    key = jax.random.PRNGKey(0)
    log_prob = -jax.random.uniform(key, (4, 6), minval=0.1, maxval=3.0)
    advantages = jax.random.normal(jax.random.PRNGKey(1), (4, 6))
    mask = jnp.ones((4, 6))
    for mode in ("vanilla", "gspo"):
        config = ActorLossConfig(loss_mode=mode)
        actor_loss = jax.jit(compute_actor_loss, static_argnames="config")
        _, metrics = actor_loss(log_prob, log_prob, advantages, mask, config=config)
        assert float(metrics["actor/ppo_kl"]) == 0.0
        assert float(metrics["actor/pg_clipfrac"]) == 0.0


# --- aggregation -------------------------------------------------------------------------------

# A has 1 token with loss 1.0; B has 3 tokens with loss 0.
AGG_LOSS = jnp.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
AGG_MASK = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "mode, scale, expected",
    [
        ("token-mean", None, 0.25),
        ("seq-mean-token-mean", None, 0.5),
        ("seq-mean-token-sum", None, 0.5),
        ("seq-mean-token-sum-norm", 4.0, 0.25),
    ],
)
def test_aggregation_worked_values_for_any_micro_batch_size(mode, scale, expected):
    counts = loss_counts(AGG_MASK)
    whole = agg_loss(AGG_LOSS, AGG_MASK, mode, loss_scale_factor=scale)
    split = sum(
        agg_loss(AGG_LOSS[i : i + 1], AGG_MASK[i : i + 1], mode, counts, loss_scale_factor=scale)
        for i in range(2)
    )
    assert float(whole) == pytest.approx(expected, rel=1e-6)
    assert float(split) == pytest.approx(expected, rel=1e-6)


# --- KL ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected", [("kl", 1.0), ("k1", 1.0), ("abs", 1.0), ("mse", 0.5), ("k2", 0.5)]
)
def test_kl_estimators(name, expected):
    assert float(kl_penalty(jnp.array(-1.0), jnp.array(-2.0), name)) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["low_var_kl", "k3", "k3+", "low_var_kl+"])
def test_k3(name):
    value = float(kl_penalty(jnp.array(-1.0), jnp.array(-2.0), name))
    assert value == pytest.approx(math.exp(-1) + 1 - 1, rel=1e-6)
    assert value == pytest.approx(0.3679, abs=1e-4)


def test_k3_clamps():
    assert float(kl_penalty(jnp.array(0.0), jnp.array(-50.0), "low_var_kl")) == 10.0


def test_adaptive_kl_controller():
    config = KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=0.1, horizon=10000)
    new = update_kl_coef(0.1, 0.2, 256, config)
    assert float(new) / 0.1 == pytest.approx(1.00512, rel=1e-6)
    assert float(update_kl_coef(0.1, 0.2, 256, KLControlConfig(type="fixed"))) == pytest.approx(0.1)


# --- value loss --------------------------------------------------------------------------------


def test_value_loss_clipped():
    # v = 2, R = 0, v_old = 1, ε_v = 0.5: max(4, 1.5²) = 4 → 2.0, not clipped.
    # v = 0, R = 0, v_old = 1: max(0, 0.5²) = 0.25 → 0.125, clipped.
    vpreds = jnp.array([[2.0, 0.0]])
    loss, metrics = compute_value_loss(
        vpreds, jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2)), cliprange_value=0.5
    )
    assert float(loss) == pytest.approx(0.5 * (4.0 + 0.25) / 2)
    assert float(metrics["critic/vf_clipfrac"]) == 0.5


# --- importance sampling, overlong -------------------------------------------------------------


def test_truncated_importance_sampling_token_and_sequence():
    old = jnp.array([[-1.0]])
    rollout = jnp.array([[-2.0]])
    for level in ("token", "sequence"):
        config = AlgorithmConfig(rollout_is=True, rollout_is_threshold=1e9, rollout_is_level=level)
        weights, _, _ = compute_rollout_importance_weights(old, rollout, jnp.ones((1, 1)), config)
        assert float(weights[0, 0]) == pytest.approx(math.e, rel=1e-6)
        config = AlgorithmConfig(rollout_is=True, rollout_is_threshold=2.0, rollout_is_level=level)
        weights, _, _ = compute_rollout_importance_weights(old, rollout, jnp.ones((1, 1)), config)
        assert float(weights[0, 0]) == 2.0


def test_dapo_overlong_penalty():
    penalty = overlong_penalty(
        jnp.array([480, 384, 100, 512]),
        max_response_length=512,
        overlong_buffer_len=128,
        penalty_factor=1.0,
    )
    np.testing.assert_allclose(penalty, [-0.75, 0.0, 0.0, -1.0])


def test_overlong_penalty_lands_on_last_valid_token():
    mask = jnp.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], jnp.float32)
    scores, penalty = apply_overlong_penalty(
        jnp.zeros((3, 4)), mask, max_response_length=4, overlong_buffer_len=2
    )
    # lengths 3, 0, 4 → exceed 1, -2, 2 over expected 2 → −0.5, 0, −1.
    np.testing.assert_allclose(penalty, [-0.5, 0.0, -1.0])
    np.testing.assert_allclose(scores, [[0, 0, -0.5, 0], [0, 0, 0, 0], [0, 0, 0, -1.0]])
