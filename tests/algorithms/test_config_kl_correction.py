"""Config building and validation, KL in the reward, rollout importance sampling."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from hybridjax.algorithms import (
    POLICY_LOSSES,
    ActorLossConfig,
    AlgorithmConfig,
    CriticLossConfig,
    KLControlConfig,
    OverlongBufferConfig,
    apply_kl_penalty,
    compute_rollout_importance_weights,
    register_policy_loss,
    rollout_probs_diff_metrics,
    update_kl_coef,
)

# --- config ----------------------------------------------------------------------------------


def test_from_config_dict_reads_verl_keys_and_ignores_the_rest():
    config = ml_collections.ConfigDict(
        {
            "algorithm": {
                "adv_estimator": "grpo",
                "gamma": 0.99,
                "norm_adv_by_std_in_grpo": False,
                "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.2, "horizon": 500},
                "some_other_stage_key": 1,
            },
            "actor": {
                "ppo_mini_batch_size": 16,
                "policy_loss": {"loss_mode": "gspo"},
                "clip_ratio": 0.25,
                "clip_ratio_high": 0.28,
                "loss_agg_mode": "seq-mean-token-mean",
                "use_kl_loss": True,
                "kl_loss_type": "k3+",
            },
            "critic": {"cliprange_value": 0.2, "optim": {"lr": 1e-5}},
            "reward_model": {"overlong_buffer": {"enable": True, "len": 128}},
        }
    )
    algo = AlgorithmConfig.from_dict(config.algorithm)
    assert algo.adv_estimator == "grpo" and algo.gamma == 0.99 and not algo.norm_adv_by_std_in_grpo
    assert algo.kl_ctrl == KLControlConfig("adaptive", 0.05, 0.2, 500)
    actor = ActorLossConfig.from_dict(config.actor)
    assert actor.loss_mode == "gspo" and actor.kl_loss_type == "k3+" and actor.use_kl_loss
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.25, 0.28, 3.0)
    assert CriticLossConfig.from_dict(config.critic).cliprange_value == 0.2
    overlong = OverlongBufferConfig.from_dict(config.reward_model.overlong_buffer)
    assert overlong.enable and overlong.len == 128 and overlong.penalty_factor == 1.0
    assert ActorLossConfig.from_dict({"policy_loss": "vanilla"}).loss_mode == "vanilla"
    hash((algo, actor))  # usable as static arguments of jitted functions


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: AlgorithmConfig(kl_penalty="k5"), "low_var_kl"),
        (lambda: AlgorithmConfig(rollout_is_level="word"), "token, sequence, geometric"),
        (lambda: AlgorithmConfig(rollout_is_mode="clip"), "truncate, mask"),
        (lambda: AlgorithmConfig(rollout_is=True), "rollout_is_threshold"),
        (lambda: KLControlConfig(type="pid"), "fixed, adaptive"),
        (lambda: KLControlConfig(type="adaptive", horizon=0), "horizon"),
        (lambda: ActorLossConfig(loss_mode="ppo"), "gspo, .*vanilla"),
        (lambda: ActorLossConfig(loss_agg_mode="mean"), "seq-mean-token-sum-norm"),
        (lambda: ActorLossConfig(clip_ratio_c=1.0), "clip_ratio_c"),
        (lambda: CriticLossConfig(loss_agg_mode="sum"), "token-mean"),
        (lambda: OverlongBufferConfig(enable=True), "len"),
    ],
)
def test_invalid_config_fails_with_the_valid_choices(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_policy_loss_registry_is_strict():
    assert {"vanilla", "gspo"} <= set(POLICY_LOSSES.names())
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *a, **k: None)


# --- KL in the reward ------------------------------------------------------------------------


def test_apply_kl_penalty():
    scores = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    old = jnp.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -2.0, -3.0]])
    ref = jnp.array([[-2.0, -1.5, -9.0], [-3.0, -3.0, -3.0], [-1.5, -2.0, -3.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, 0.1, "kl")
    # KL per token: row 0 [1, 0.5, -], row 1 empty, row 2 [0.5].
    np.testing.assert_allclose(rewards, [[-0.1, 0.95, 0.0], [0.0, 0.0, 0.0], [0.45, 0.0, 0.0]])
    # Per-row means 0.75 and 0.5 (the empty row left out) → 0.625.
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx(0.625)
    assert float(metrics["actor/reward_kl_penalty_coeff"]) == pytest.approx(0.1)


def test_adaptive_controller_lowers_the_coefficient_below_target_and_is_jittable():
    config = KLControlConfig(type="adaptive", target_kl=0.1, horizon=1000)
    step = jax.jit(update_kl_coef, static_argnames="config")
    # KL 0.02: error clipped to −0.2 → × (1 − 0.2·100/1000) = × 0.98.
    assert float(step(jnp.float32(0.5), 0.02, 100, config=config)) == pytest.approx(0.49)
    # KL 0.11: error 0.1 → × 1.01.
    assert float(step(jnp.float32(0.5), 0.11, 100, config=config)) == pytest.approx(0.505)


# --- rollout importance sampling --------------------------------------------------------------

OLD = jnp.array([[-1.0, -1.0, -1.0], [-1.0, -0.5, -1.0], [-1.0, -1.0, -1.0]])
ROLLOUT = jnp.array([[-2.0, -1.0, -0.5], [-1.0, -1.0, -20.0], [-1.0, -1.0, -1.0]])
MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def weights_for(**overrides):
    config = AlgorithmConfig(rollout_is=True, **{"rollout_is_threshold": 2.0, **overrides})
    return compute_rollout_importance_weights(OLD, ROLLOUT, MASK, config)


def test_token_level_truncate():
    weights, mask, metrics = weights_for()
    e = math.e
    np.testing.assert_allclose(
        weights, [[2.0, 1.0, e**-0.5], [1.0, min(e**0.5, 2.0), 0.0], [0] * 3]
    )
    np.testing.assert_array_equal(mask, MASK)
    assert float(metrics["mismatch/rollout_is_max"]) == pytest.approx(e, rel=1e-6)
    assert float(metrics["mismatch/rollout_is_ratio_fraction_high"]) == pytest.approx(1 / 5)


@pytest.mark.parametrize(
    "level, row0, row1", [("sequence", 0.5, 0.5), ("geometric", 0.5 / 3, 0.25)]
)
def test_sequence_and_geometric_levels(level, row0, row1):
    # Σ log-ratio: row 0 = 1 + 0 − 0.5 = 0.5 over 3 tokens; row 1 = 0 + 0.5 = 0.5 over 2 tokens.
    weights, _, _ = weights_for(rollout_is_level=level, rollout_is_threshold=10.0)
    expected = np.array([[math.exp(row0)] * 3, [math.exp(row1)] * 2 + [0.0], [0.0] * 3])
    np.testing.assert_allclose(weights, expected, rtol=1e-6)


def test_mask_mode_keeps_true_ratios_and_drops_outliers():
    weights, mask, metrics = weights_for(rollout_is_mode="mask", rollout_is_threshold=1.5)
    # Bounds [1/1.5, 1.5]: e (row 0 token 0) and e^-0.5 = 0.61 (row 0 token 2) are out.
    np.testing.assert_allclose(weights[0, 0], math.e, rtol=1e-6)
    np.testing.assert_array_equal(mask, [[0, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert float(metrics["mismatch/rollout_is_masked_fraction"]) == pytest.approx(3 / 5)


def test_veto_drops_the_whole_sequence():
    _, mask, metrics = weights_for(rollout_is_veto_threshold=0.7)
    np.testing.assert_array_equal(mask, [[0, 0, 0], [1, 1, 0], [0, 0, 0]])
    assert float(metrics["mismatch/rollout_is_veto_fraction"]) == pytest.approx(0.5)


def test_weights_carry_no_gradient_and_empty_batch_is_finite():
    config = AlgorithmConfig(rollout_is=True, rollout_is_threshold=2.0)

    def total_weight(old):
        return jnp.sum(compute_rollout_importance_weights(old, ROLLOUT, MASK, config)[0])

    np.testing.assert_array_equal(jax.grad(total_weight)(OLD), np.zeros((3, 3)))
    _, _, metrics = compute_rollout_importance_weights(OLD, ROLLOUT, jnp.zeros((3, 3)), config)
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_rollout_probs_diff_metrics():
    old = jnp.log(jnp.array([[0.5, 0.25], [0.9, 0.1]]))
    rollout = jnp.log(jnp.array([[0.4, 0.25], [0.1, 0.1]]))
    metrics = rollout_probs_diff_metrics(old, rollout, jnp.array([[1.0, 1.0], [1.0, 0.0]]))
    # |Δp| on valid tokens: 0.1, 0, 0.8.
    assert float(metrics["training/rollout_probs_diff_mean"]) == pytest.approx(0.3, rel=1e-5)
    assert float(metrics["training/rollout_probs_diff_max"]) == pytest.approx(0.8, rel=1e-5)
    assert float(metrics["training/rollout_probs_diff_std"]) == pytest.approx(
        np.std([0.1, 0.0, 0.8]), rel=1e-5
    )
