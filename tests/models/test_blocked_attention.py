"""The blocked attention path (GPU/TPU) equals the dense jnp path (CPU, the reference).

Random ragged packed buffers laid out by `hybridjax.models.packing`: shared-prompt groups of 1
to 8 responses, empty responses, responses at max length, prompts from 1 token to the full
width; outputs and gradients in float32 within 1e-5, with and without a sliding window, block
sizes that do not divide the buffer. Then the model end to end on both paths, and the compiled
memory: doubling T about doubles the blocked path's scratch and quadruples the dense one's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models import attention, packing
from hybridjax.models.attention import SelfAttentionMask, self_attention
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM

TOL = dict(atol=1e-5, rtol=1e-5)
H, KV, D = 4, 2, 8
P, R = 24, 40  # prompt and response columns


def packed_buffers(seed: int, group_sizes=(1, 8, 3, 5, 2, 1)):
    """ids of one packing step holding every row: (segment ids, prefix ids, positions, valid),
    each rows×row_length. Prompts of 1…P tokens, responses of 0…R (one empty, one full)."""
    rng = np.random.default_rng(seed)
    b = sum(group_sizes)
    ids = np.zeros((b, P + R), np.int32)
    row = 0
    for g, size in enumerate(group_sizes):
        p = P if g == 0 else int(rng.integers(1, P + 1))
        ids[row : row + size, P - p : P] = rng.integers(1, 50, p)
        row += size
    lengths = rng.integers(0, R + 1, b)
    lengths[1], lengths[2] = 0, R
    ids[:, P:] = rng.integers(1, 50, (b, R)) * (np.arange(R)[None] < lengths[:, None])
    groups = np.repeat(np.arange(len(group_sizes)), group_sizes)
    config = packing.PackingConfig(row_length=150, rows=6)
    ids, mask = jnp.asarray(ids), jnp.asarray((ids > 0).astype(np.int32))
    pl = packing.plan(ids, mask, R, jnp.asarray(groups), config)
    assert int(pl.num_buffers) <= config.rows  # every row in step 0
    buf = packing.buffer(pl, ids, jnp.int32(0))
    return buf["segment_ids"], buf["prefix_ids"], buf["positions"], buf["valid"]


def random_qkv(shape, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (*shape, H, D))
    return q, *(jax.random.normal(key, (*shape, KV, D)) for key in keys[1:])


def attention_loss(mask):
    """A scalar of the valid queries' outputs, and those outputs B×T×H×D."""
    w = jax.random.normal(jax.random.key(9), mask.positions.shape + (H, D))

    def loss(q, k, v):
        out = self_attention(q, k, v, mask, 2)  # B×K×T×G×D
        out = out.transpose(0, 2, 1, 3, 4).reshape(q.shape)
        out = jnp.where(mask.valid[..., None, None], out, 0.0)
        return jnp.sum(jnp.sin(out) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# (block, query chunk): one block and one chunk; or blocks of 32 (the last one padded) in
# chunks of 64 queries, each chunk scanning only the key blocks up to its end
@pytest.mark.parametrize("seed, window, block, chunk", [(0, None, 150, 512), (1, 7, 32, 64)])
def test_blocked_equals_dense_on_packed_shared_prompt_buffers(
    seed, window, block, chunk, monkeypatch
):
    ids = packed_buffers(seed)
    q, k, v = random_qkv(ids[0].shape, seed)
    dense = SelfAttentionMask.create(ids[2], ids[3], ids[:2], window, impl="jnp")
    (_, out_dense), g_dense = attention_loss(dense)(q, k, v)
    monkeypatch.setattr("hybridjax.models.blocked_attention.DEFAULT_BLOCK", block)
    monkeypatch.setattr("hybridjax.models.blocked_attention.QUERY_CHUNK", chunk)
    blocked = SelfAttentionMask.create(ids[2], ids[3], ids[:2], window, impl="blocked")
    assert blocked.bias is None  # nothing T×T
    (_, out), g = attention_loss(blocked)(q, k, v)
    np.testing.assert_allclose(out, out_dense, **TOL)
    for a, b in zip(g, g_dense, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_blocked_equals_dense_on_padded_rows(monkeypatch):
    """A padded batch (no segments): left, right and both-sides padding, rows without any
    valid token; every valid query's output and all gradients agree."""
    valid = np.ones((4, 45), bool)
    valid[0, :20], valid[1, -9:], valid[2, :3], valid[2, -1], valid[3] = False, False, 0, 0, 0
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    valid = jnp.asarray(valid)
    q, k, v = random_qkv(valid.shape, 3)
    monkeypatch.setattr("hybridjax.models.blocked_attention.DEFAULT_BLOCK", 8)
    monkeypatch.setattr("hybridjax.models.blocked_attention.QUERY_CHUNK", 16)  # 3 chunks
    (_, out_dense), g_dense = attention_loss(
        SelfAttentionMask.create(positions, valid, impl="jnp")
    )(q, k, v)
    (_, out), g = attention_loss(SelfAttentionMask.create(positions, valid, impl="blocked"))(
        q, k, v
    )
    np.testing.assert_allclose(out, out_dense, **TOL)
    for a, b in zip(g, g_dense, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_the_backend_picks_the_path():
    assert attention.attention_backend() == "jnp"  # CPU: the dense reference, unchanged
    ids = packed_buffers(0)
    assert SelfAttentionMask.create(ids[2], ids[3], ids[:2]).impl == "jnp"
    with pytest.raises(ValueError, match="'jnp' or 'blocked'"):
        SelfAttentionMask.create(ids[2], ids[3], impl="cudnn")


def test_model_logits_and_gradients_equal_on_both_paths(monkeypatch):
    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=KV, attention_bias=True,
    )  # fmt: skip
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    seg, prefix, positions, valid = packed_buffers(2)
    ids = jax.random.randint(jax.random.key(1), seg.shape, 1, 64) * valid

    def loss(params):
        logits = nnx.merge(graphdef, params)(ids, valid, positions, (seg, prefix))
        lp = jax.nn.log_softmax(logits)[..., 0]
        return jnp.sum(jnp.where(valid, lp, 0.0)), lp

    grads = {}
    for impl in ("jnp", "blocked"):
        monkeypatch.setattr(attention, "attention_backend", lambda impl=impl: impl)
        (_, lp), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        grads[impl] = (jnp.where(valid, lp, 0.0), g)
    for a, b in zip(*(jax.tree.leaves(g) for g in grads.values()), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def scratch_bytes(impl: str, t: int) -> int:
    """XLA's temp bytes of one forward + backward of attention over a buffer of t tokens of
    segments of 32 tokens sharing prompts of 32 (compiled, not run)."""
    seg = jnp.arange(t) // 32
    ids = (seg[None], (seg - seg % 4)[None], (jnp.arange(t) % 128)[None], jnp.ones((1, t), bool))
    q, k, v = (jax.ShapeDtypeStruct((1, t, n, 32), jnp.float32) for n in (4, 4, 4))

    def loss(q, k, v):
        mask = SelfAttentionMask.create(ids[2], ids[3], ids[:2], impl=impl)
        return jnp.sum(self_attention(q, k, v, mask))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blocked_memory_grows_linearly_in_tokens(monkeypatch):
    monkeypatch.setattr("hybridjax.models.blocked_attention.QUERY_CHUNK", 256)  # 4 → 8 chunks
    dense = [scratch_bytes("jnp", t) for t in (1024, 2048)]
    blocked = [scratch_bytes("blocked", t) for t in (1024, 2048)]
    assert dense[1] / dense[0] > 3.5, dense  # T×T logits, probabilities and bias
    assert blocked[1] / blocked[0] < 2.3, blocked
    assert blocked[1] < dense[1] / 4, (blocked, dense)
