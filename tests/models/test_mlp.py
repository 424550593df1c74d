"""The MLP's stacked gate/up matmul (many tokens) equals the two-matmul form (few tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridjax.models import decoder
from hybridjax.models.config import ModelConfig


def test_stacked_and_separate_gate_up_agree(monkeypatch):
    config = ModelConfig(hidden_size=16, intermediate_size=24)
    mlp = decoder.MLP(config, nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
    grad = lambda: nnx.grad(loss, argnums=(0, 1))(mlp, x)
    separate = grad()  # 10 tokens < 4 · 16
    monkeypatch.setattr(decoder, "STACKED_GATE_UP_MIN_TOKENS_PER_WIDTH", 0)
    stacked = grad()
    want = x.reshape(10, 16)
    gate = jax.nn.silu(want @ mlp.gate_proj[...])
    out = (gate * (want @ mlp.up_proj[...])) @ mlp.down_proj[...]
    np.testing.assert_allclose(np.asarray(mlp(x)).reshape(10, 16), out, atol=1e-6)
    for a, b in zip(jax.tree.leaves(separate), jax.tree.leaves(stacked), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
