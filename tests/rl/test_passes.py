"""The device stages wired to the algorithm core: rollout importance sampling in the actor
update, DAPO's overlong penalty and the adaptive KL controller in the rewards, ReMax's greedy
baselines in the advantages. Hand-computed values on a tiny model and hand-built batches."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.algorithms.advantages import needs_reward_baseline
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch
from tests.rl.tiny_run import load_config_file

# 4 responses of 4 tokens after 3-token prompts; valid lengths 4, 3, 2, 1.
MASK_BxR = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)


def _stage_config(**changes):
    """configs/tiny.py resized to one mini-batch of the 4 rows above on one device."""
    c = load_config_file("tiny")
    c.data.train_batch_size = 4
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.response_length = c.data.max_response_length = 4
    c.update_from_flattened_dict(changes)
    return build.stage_config(c, total_steps=2, data_parallel=1)


def _batch(scores_B=(1.0, 0.0, 0.5, 0.0)):
    rng = np.random.default_rng(0)
    batch = make_batch(
        jnp.asarray(rng.integers(1, 60, (4, 3))),
        jnp.ones((4, 3), jnp.int32),
        jnp.asarray(rng.integers(1, 60, (4, 4)) * MASK_BxR.astype(int)),
        jnp.asarray(MASK_BxR),
    )
    last = MASK_BxR.sum(-1).astype(int) - 1
    scores = np.zeros((4, 4), np.float32)
    scores[np.arange(4), last] = scores_B
    return batch.replace(token_level_scores=jnp.asarray(scores))


@pytest.fixture(scope="module")
def actor():
    config = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    state = build.init_train_state(params, _stage_config().actor_optim)
    return graphdef, state


def test_truncated_importance_weights_scale_the_policy_loss(actor):
    """Rollout log-probs one nat below the trainer's: w = e = 2.718, truncated at 2.0, so the
    on-policy (ratio 1) token-mean policy loss doubles; mask mode drops every token instead."""
    graphdef, state = actor
    plain = _stage_config()
    tis = _stage_config(**{"algorithm.rollout_is": True, "algorithm.rollout_is_threshold": 2.0})
    batch, _ = passes.compute_old_log_prob(graphdef, state.params, _batch(), plain)
    batch = batch.replace(rollout_log_probs=batch.old_log_probs - MASK_BxR)
    advantages = jnp.asarray(np.array([[1.0], [-0.5], [2.0], [-1.0]]) * MASK_BxR)

    def update(cfg):
        b, metrics = passes.compute_old_log_prob(graphdef, state.params, batch, cfg)
        b = b.replace(advantages=advantages)
        _, update_metrics, nan = passes.update_actor(graphdef, state, b, jax.random.key(0), cfg)
        assert int(nan) == 0
        return b, metrics | update_metrics

    base_batch, base = update(plain)
    weighted_batch, weighted = update(tis)
    assert base_batch.rollout_is_weights is None
    np.testing.assert_allclose(weighted_batch.rollout_is_weights, 2.0 * MASK_BxR, rtol=1e-6)
    assert weighted["mismatch/rollout_is_mean"] == pytest.approx(2.0)
    assert weighted["mismatch/rollout_is_max"] == pytest.approx(math.e, rel=1e-5)
    assert weighted["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(1.0)
    # token-mean of −A over 10 valid tokens: −(4·1 − 3·0.5 + 2·2 − 1) / 10 = −0.55
    assert float(base["actor/pg_loss"]) == pytest.approx(-0.55, rel=1e-5)
    assert float(weighted["actor/pg_loss"]) == pytest.approx(2 * -0.55, rel=1e-5)
    assert float(base["actor/ppo_kl"]) == 0.0
    # |p_old − p_rollout| = p_old (1 − 1/e) per token
    p_old = np.exp(np.asarray(batch.old_log_probs))[MASK_BxR > 0]
    diff_max = float(base["training/rollout_probs_diff_max"])
    assert diff_max == pytest.approx(p_old.max() * (1 - 1 / math.e), rel=1e-5)
    assert "mismatch/rollout_is_mean" not in base  # no threshold: no weights, no metrics

    mask_mode = _stage_config(**{
        "algorithm.rollout_is": True, "algorithm.rollout_is_threshold": 2.0,
        "algorithm.rollout_is_mode": "mask"})  # fmt: skip
    masked, metrics = passes.compute_old_log_prob(graphdef, state.params, batch, mask_mode)
    assert float(jnp.sum(masked.response_mask)) == 0.0  # e > 2: every token rejected
    assert float(metrics["mismatch/rollout_is_masked_fraction"]) == 1.0


def test_overlong_penalty_on_the_last_valid_token():
    """L_max = R = 4, buffer 2, factor 1: length 4 → −1, length 3 → −0.5, ≤ 2 → 0."""
    overlong = "reward_model.overlong_buffer"
    cfg = _stage_config(**{f"{overlong}.enable": True, f"{overlong}.len": 2})
    batch = _batch().replace(values=jnp.zeros((4, 4)))
    batch, _, metrics = passes.compute_advantage(batch, jnp.float32(0.001), cfg)
    expected = np.array(_batch().token_level_scores)
    expected[0, 3] -= 1.0
    expected[1, 2] -= 0.5
    np.testing.assert_allclose(batch.token_level_rewards, expected)
    np.testing.assert_array_equal(batch.token_level_scores, _batch().token_level_scores)
    assert float(metrics["reward/overlong_penalty/mean"]) == pytest.approx(-0.375)
    assert float(metrics["reward/overlong_fraction"]) == 0.5


def test_adaptive_kl_controller_advances_each_step():
    """KL 0.2 per token against target 0.1 (error clipped to 0.2), 4 rows, horizon 100:
    β ← β·(1 + 0.2·4/100) = 1.008 β, and the reward loses β·0.2 on every valid token."""
    cfg = _stage_config(**{
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.horizon": 100, "algorithm.kl_ctrl.target_kl": 0.1})  # fmt: skip
    mask = jnp.asarray(MASK_BxR)
    batch = _batch().replace(
        old_log_probs=-1.0 * mask, ref_log_prob=-1.2 * mask, values=jnp.zeros((4, 4))
    )
    beta = jnp.float32(0.5)
    out, next_beta, metrics = passes.compute_advantage(batch, beta, cfg)
    assert float(next_beta) == pytest.approx(0.5 * 1.008, rel=1e-6)
    assert float(metrics["actor/kl_coef"]) == pytest.approx(0.5)  # the β this step used
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx(0.2, rel=1e-5)
    expected = np.asarray(batch.token_level_scores) - 0.5 * 0.2 * MASK_BxR
    np.testing.assert_allclose(out.token_level_rewards, expected, rtol=1e-5, atol=1e-6)
    _, twice, _ = passes.compute_advantage(batch, next_beta, cfg)
    assert float(twice) == pytest.approx(0.5 * 1.008**2, rel=1e-6)


def test_remax_uses_the_greedy_baseline():
    """ReMax declares that it needs a greedy baseline; advantage = score − baseline on every
    valid token."""
    assert needs_reward_baseline("remax")
    assert not needs_reward_baseline("grpo") and not needs_reward_baseline("gae")
    cfg = _stage_config(**{"algorithm.adv_estimator": "remax"})
    batch = _batch().replace(reward_baselines=jnp.asarray([0.5, 0.5, 1.0, 0.0]))
    batch, _, _ = passes.compute_advantage(batch, jnp.float32(0.0), cfg)
    expected = np.array([[0.5], [-0.5], [-0.5], [0.0]]) * MASK_BxR
    np.testing.assert_allclose(batch.advantages, expected, atol=1e-7)
    with pytest.raises(ValueError, match="reward_baselines_B"):
        passes.compute_advantage(_batch(), jnp.float32(0.0), cfg)
