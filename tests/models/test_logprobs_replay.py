"""Sampling-mask replay in the LM head (`hybridjax.models.logprobs`, `threshold_BxT`): the
log-prob, entropy and their gradients are those of the policy truncated to the support the
rollout sampled from, against autodiff of a dense reference on a tiny vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.logprobs import LogProbConfig, token_log_probs
from hybridjax.rollout.sampling import sample_tokens
from hybridjax.sharding.mesh import TRAIN_AXES

V, D, T = 24, 16, 7
TEMPERATURE = 0.7


def _head():
    config = ModelConfig(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    return nnx.split(CausalLM(config, nnx.Rngs(0)))


def _dense(model, hidden, targets, threshold):
    """The truncated policy written out: full logits, −inf off the support, log_softmax."""
    z = model.logits(hidden) / TEMPERATURE
    keep = (z >= threshold[..., None]) | (jnp.arange(V) == targets[..., None])
    lp_all = jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)
    lp = jnp.take_along_axis(lp_all, targets[..., None], axis=-1)[..., 0]
    safe = jnp.where(keep, lp_all, 0.0)
    return lp, -jnp.sum(jnp.where(keep, jnp.exp(safe) * safe, 0.0), axis=-1)


def _case():
    """Hidden states, sampled-looking targets inside each position's top-k support, and the
    thresholds of top-k sets of sizes 1..6 (−inf on one row: the whole vocabulary), halfway
    to the next logit as the sampler records them."""
    graphdef, params = _head()
    hidden = jax.random.normal(jax.random.key(1), (3, T, D))
    z = nnx.merge(graphdef, params).logits(hidden) / TEMPERATURE
    k = jax.random.randint(jax.random.key(2), (3, T), 1, 7)
    ranked = -jnp.sort(-z, axis=-1)  # τ halfway between the k-th and (k+1)-th, as sampled
    kth, next_ = (jnp.take_along_axis(ranked, i[..., None], -1)[..., 0] for i in (k - 1, k))
    threshold = (kth + next_) / 2
    threshold = threshold.at[2].set(-jnp.inf)
    pick = jax.random.randint(jax.random.key(3), (3, T), 0, 100) % k  # a rank inside the set
    order = jnp.argsort(-z, axis=-1)
    targets = jnp.take_along_axis(order, pick[..., None], axis=-1)[..., 0]
    return graphdef, params, hidden, targets, threshold


def _vocab_parallel_mesh():
    """data × expert × fsdp × tensor = 2 × 1 × 2 × 2: the vocabulary split 4 ways."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 2, 2), TRAIN_AXES)


@pytest.mark.parametrize("head", ["fused", "unfused", "vocab_parallel"])
def test_replayed_log_probs_and_gradients_equal_the_truncated_policy(head):
    """Values and gradients (head weights and hidden states) of Σ w·log π + Σ u·H with the
    replayed support = autodiff of the dense truncated policy; chunks of 3 (T = 7 padded);
    also with the fused head vocab-parallel over a mesh (masked pmax / psum)."""
    graphdef, params, hidden, targets, threshold = _case()
    mesh = _vocab_parallel_mesh() if head == "vocab_parallel" else None
    config = LogProbConfig(use_fused_kernels=head != "unfused", chunk_size=3, mesh=mesh)
    weights = jnp.arange(1.0, T + 1)

    def loss(params, hidden, replay):
        model = nnx.merge(graphdef, params)
        if replay:
            lp, ent = token_log_probs(model, hidden, targets, TEMPERATURE, config, True, threshold)
        else:
            lp, ent = _dense(model, hidden, targets, threshold)
        return jnp.sum(lp * weights) + jnp.sum(ent * jnp.cos(weights)), (lp, ent)

    grad = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), static_argnums=2)
    (_, got), got_grads = grad(params, hidden, True)
    (_, want), want_grads = grad(params, hidden, False)
    leaves = jax.tree.leaves((want, want_grads))
    for a, b in zip(jax.tree.leaves((got, got_grads)), leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    # the truncation matters: the full-vocabulary log-probs differ where the support is short
    full, _ = token_log_probs(nnx.merge(graphdef, params), hidden, targets, TEMPERATURE, config)
    assert np.all(np.asarray(got[0][:2]) > np.asarray(full[:2]) + 1e-3)
    np.testing.assert_allclose(got[0][2], full[2], rtol=1e-5, atol=1e-6)


def test_hand_computed_support():
    """Logits (0, ln 2, ln 3, 0 …) at T = 1 (identity head) with τ = ln 2: the support is
    {1, 2}, so log π(2) = ln 3/5 and H = −(0.4 ln 0.4 + 0.6 ln 0.6); a target below τ (a
    rounding difference) stays in: support {0, 1, 2} → log π(0) = ln 1/6."""
    graphdef, params = _head()
    model = nnx.merge(graphdef, params)
    model.lm_head.set_value(jnp.zeros((D, V)).at[:3, :3].set(jnp.eye(3)))
    hidden = jnp.zeros((1, 2, D)).at[0, :, :3].set(jnp.log(jnp.asarray([1.0, 2.0, 3.0])))
    threshold = jnp.full((1, 2), np.log(2.0), jnp.float32)
    lp, ent = token_log_probs(
        model, hidden, jnp.asarray([[2, 0]]), 1.0, LogProbConfig(), True, threshold
    )
    np.testing.assert_allclose(lp[0], [np.log(0.6), np.log(1 / 6)], rtol=1e-5)
    np.testing.assert_allclose(ent[0, 0], -(0.4 * np.log(0.4) + 0.6 * np.log(0.6)), rtol=1e-5)


class _IdentityHead:
    """A head whose logits are the hidden states (D = V): the fused path's `head_weight`."""

    def __init__(self, vocab: int):
        self.weight = jnp.eye(vocab, dtype=jnp.float32)

    def head_weight(self):
        return self.weight, "dv"

    def logits(self, hidden):
        return hidden @ self.weight


@pytest.mark.parametrize("top_k, top_p, kept_mass", [(-1, 0.7, 0.8), (3, 1.0, 0.95), (2, 0.7, 0.8)])
def test_rollout_and_trainer_agree_by_hand(top_k, top_p, kept_mass):
    """p = (0.5, 0.3, 0.15, 0.05): top-p 0.7 keeps {0, 1}, top-k 3 keeps {0, 1, 2}. The
    rollout's log-prob is log(p / kept mass); the trainer over the full vocabulary gets
    log p (ratio = the kept mass), over the replayed support log(p / kept mass) (ratio 1)."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray(np.tile(probs, (16, 1)), jnp.float32))
    uniform = jnp.linspace(0.0, 0.99, 16)
    ones = jnp.ones(16)
    tokens, rollout, threshold = sample_tokens(
        logits, uniform, ones, jnp.full(16, top_k), top_p * ones, True
    )
    np.testing.assert_allclose(rollout, np.log(probs[np.asarray(tokens)] / kept_mass), rtol=1e-5)
    head, hidden, targets = _IdentityHead(4), logits[:, None], tokens[:, None]
    full, _ = token_log_probs(head, hidden, targets, 1.0, LogProbConfig())
    replayed, _ = token_log_probs(
        head, hidden, targets, 1.0, LogProbConfig(), False, threshold[:, None]
    )
    np.testing.assert_allclose(np.exp(full[:, 0] - rollout), kept_mass, rtol=1e-5)
    np.testing.assert_allclose(np.exp(replayed[:, 0] - rollout), 1.0, rtol=1e-6)
    # no truncation: τ = −inf, and the trainer's two semantics agree
    _, _, none = sample_tokens(logits, uniform, ones, jnp.full(16, -1), ones, True)
    assert np.all(np.isneginf(none))
