"""On-policy distillation's per-token advantage and direct loss against hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.algorithms.config import ActorLossConfig
from hybridjax.algorithms.distillation import (
    DistillationConfig,
    distillation_advantages,
    distillation_loss_per_token,
)
from hybridjax.algorithms.losses import compute_actor_loss

# 2 responses of 3 tokens; the second has 2 valid tokens.
STUDENT = np.array([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]], np.float32)
TEACHER = np.array([[-1.5, -1.0, -0.5], [-2.1, -2.0, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
TASK = np.array([[0.3, 0.3, 0.3], [-0.2, -0.2, 0.0]], np.float32)


def _advantages(**kw):
    config = DistillationConfig(enabled=True, **kw)
    return distillation_advantages(*map(jnp.asarray, (TASK, STUDENT, TEACHER, MASK)), config)


def test_reward_is_minus_the_reverse_kl_per_token():
    # k1 = student − teacher: [0.5, −1, 0], [2, −1, (masked)]; advantage −k1
    adv, metrics = _advantages(loss_mode="reward")
    np.testing.assert_allclose(adv, [[-0.5, 1.0, 0.0], [-2.0, 1.0, 0.0]], atol=1e-6)
    assert float(metrics["distill/reverse_kl"]) == pytest.approx((0.5 - 1 + 0 + 2 - 1) / 5)


def test_reward_mixed_with_the_task_advantage_by_the_coefficient():
    adv, _ = _advantages(loss_mode="reward", use_policy_loss=True, distillation_loss_coef=0.5)
    want = TASK - 0.5 * np.array([[0.5, -1.0, 0.0], [2.0, -1.0, 0.0]])
    np.testing.assert_allclose(adv, want * MASK, atol=1e-6)


def test_same_teacher_as_student_gives_zero_reward():
    config = DistillationConfig(enabled=True, loss_mode="reward")
    s, m = jnp.asarray(STUDENT), jnp.asarray(MASK)
    adv, metrics = distillation_advantages(jnp.asarray(TASK), s, s, m, config)
    assert np.all(np.asarray(adv) == 0.0) and float(metrics["distill/reverse_kl"]) == 0.0


def test_loss_modes_keep_or_drop_the_task_advantage():
    kept, _ = _advantages(loss_mode="k3", use_policy_loss=True)
    np.testing.assert_allclose(kept, TASK * MASK)
    dropped, _ = _advantages(loss_mode="k3")
    assert np.all(np.asarray(dropped) == 0.0)


def test_direct_losses_and_their_gradients():
    x = STUDENT - TEACHER
    k1 = distillation_loss_per_token(jnp.asarray(STUDENT), jnp.asarray(TEACHER), "k1")
    k3 = distillation_loss_per_token(jnp.asarray(STUDENT), jnp.asarray(TEACHER), "k3")
    np.testing.assert_allclose(k1, x, atol=1e-6)
    valid = MASK > 0  # the padded token's x = −8 is past verl's clamp of k3 to 10
    np.testing.assert_allclose(np.asarray(k3)[valid], (np.exp(-x) + x - 1)[valid], rtol=1e-5)
    assert float(k3[1, 2]) == 10.0
    # d k3 / d log π = 1 − e^(−x); nothing flows into the teacher
    g_s, g_t = jax.grad(lambda s, t: distillation_loss_per_token(s, t, "k3").sum(), argnums=(0, 1))(
        jnp.asarray(STUDENT), jnp.asarray(TEACHER)
    )
    np.testing.assert_allclose(np.asarray(g_s)[valid], (1 - np.exp(-x))[valid], rtol=1e-5)
    assert np.all(np.asarray(g_t) == 0.0)


def test_actor_loss_adds_the_coefficient_times_the_distillation_loss():
    s, t, m = jnp.asarray(STUDENT), jnp.asarray(TEACHER), jnp.asarray(MASK)
    zeros = jnp.zeros_like(s)
    config = ActorLossConfig()  # token-mean
    distill = DistillationConfig(enabled=True, loss_mode="k3", distillation_loss_coef=0.25)
    loss, metrics = compute_actor_loss(
        s, s, zeros, m, config=config, teacher_log_prob_BxT=t, distillation=distill
    )
    x = (STUDENT - TEACHER)[MASK > 0]
    want = np.mean(np.exp(-x) + x - 1)
    assert float(metrics["actor/distillation_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(loss) == pytest.approx(0.25 * want, rel=1e-5)  # the policy loss is 0 here
    assert float(metrics["distill/reverse_kl"]) == pytest.approx(np.mean(x), rel=1e-5)
    with pytest.raises(ValueError, match="teacher_log_prob_BxT"):
        compute_actor_loss(s, s, zeros, m, config=config, distillation=distill)


def test_unknown_loss_mode_names_the_key_and_choices():
    with pytest.raises(ValueError, match=r"distillation.loss_mode.*'reward', 'k1', 'k3'"):
        DistillationConfig(loss_mode="jsd")


def test_top_k_forward_kl_by_hand_and_with_k_equal_v():
    """π_teacher = [1/2, 1/4, 1/8, 1/8], π_θ uniform over 4: KL(π_teacher ‖ π_θ) =
    ½ ln 2 + ¼ · 0 + 2 · ⅛ ln ½ = ¼ ln 2; the top 2 alone give ½ ln 2 (not renormalised)."""
    from hybridjax.algorithms.distillation import top_k_forward_kl

    teacher = jnp.log(jnp.array([[[0.5, 0.25, 0.125, 0.125]]]))
    student = jnp.log(jnp.full((1, 1, 4), 0.25))
    np.testing.assert_allclose(top_k_forward_kl(student, teacher), [[0.25 * np.log(2)]], atol=1e-6)
    top2 = top_k_forward_kl(student[..., :2], teacher[..., :2])
    np.testing.assert_allclose(top2, [[0.5 * np.log(2)]], atol=1e-6)
    # k = V on random distributions: the exact KL, whatever the order of the ids
    rng = np.random.default_rng(0)
    t = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32), -1)
    s = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32), -1)
    exact = np.sum(np.exp(t) * (t - s), -1)
    order = np.argsort(-np.asarray(t), -1)
    take = lambda x: jnp.take_along_axis(x, jnp.asarray(order), -1)
    np.testing.assert_allclose(top_k_forward_kl(take(s), take(t)), exact, atol=1e-5)
    # the gradient reaches the student only: −π_teacher per kept token
    grad = jax.grad(lambda x: jnp.sum(top_k_forward_kl(x, teacher)))(student)
    np.testing.assert_allclose(grad, -jnp.exp(teacher), atol=1e-6)
