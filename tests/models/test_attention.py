"""Attention kernels against a loop-over-heads numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.models.attention import (
    attention_bias,
    attention_mask,
    dot_product_attention,
    grouped_attention,
)
from hybridjax.models.decoder import default_positions

B, T, H, K, D = 3, 11, 4, 2, 8


def _reference(q, k, v, mask):
    """softmax(q·kᵀ/√D) v per (row, head), masked keys excluded; B×T×H×D, zeros for rows
    with no valid key."""
    out = np.zeros(q.shape, np.float64)
    g = q.shape[2] // k.shape[2]
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            logits = q[b, :, h] @ k[b, :, h // g].T / np.sqrt(q.shape[3])
            for t in range(q.shape[1]):
                keys = mask[b, t]
                if keys.any():
                    w = np.exp(logits[t, keys] - logits[t, keys].max())
                    out[b, t, h] = (w / w.sum()) @ v[b, keys, h // g]
    return out


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(B, T, n, D)).astype(np.float32) for n in (H, K, K))
    token_mask = np.ones((B, T), bool)
    token_mask[0, :4] = False  # left padding
    token_mask[1, -3:] = False  # right padding
    token_mask[2, :2] = False  # both
    token_mask[2, -1] = False
    positions = np.asarray(default_positions(jnp.asarray(token_mask)))
    mask = np.asarray(attention_mask(positions, positions, token_mask))
    return q, k, v, token_mask, mask


@pytest.mark.parametrize("chunks", [1, 3, T])
def test_grouped_attention_skipping_upper_blocks_is_exact(batch, chunks):
    q, k, v, token_mask, mask = batch
    attend = jax.jit(grouped_attention, static_argnums=4)
    out = attend(q, k, v, attention_bias(mask), chunks)  # B×K×T×G×D
    out = np.asarray(out).transpose(0, 2, 1, 3, 4).reshape(B, T, H, D)
    want = _reference(q, k, v, mask)
    np.testing.assert_allclose(out[token_mask], want[token_mask], atol=2e-6)


def test_dot_product_attention_zeroes_rows_without_keys(batch):
    q, k, v, _, mask = batch
    mask = mask.copy()
    mask[1, 5] = False  # query (1, 5) sees no key
    out = np.asarray(jax.jit(dot_product_attention)(q, k, v, mask))
    np.testing.assert_allclose(out, _reference(q, k, v, mask), atol=2e-6)
    assert not out[1, 5].any()


def test_causal_lm_logits_do_not_depend_on_query_chunks(monkeypatch):
    from flax import nnx

    from hybridjax.models import decoder
    from hybridjax.models.config import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, attention_bias=True)
    model = decoder.CausalLM(config, nnx.Rngs(0))
    length = 3 * decoder.MIN_QUERY_CHUNK + 5  # 3 chunks
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 64, size=(2, length)))
    mask = np.ones((2, length), bool)
    mask[0, :30] = False
    mask[1, -70:] = False
    forward = lambda: np.asarray(nnx.jit(lambda m, i, k: m(i, k))(model, ids, jnp.asarray(mask)))
    chunked = forward()
    monkeypatch.setattr(decoder, "MAX_QUERY_CHUNKS", 1)
    whole = forward()
    np.testing.assert_allclose(chunked[mask], whole[mask], atol=1e-5)
