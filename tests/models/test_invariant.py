"""Parity mode (`ModelConfig.batch_invariant`): a row's results do not depend on the rows beside
it. The primitives at 1..N rows, the attention over pages equal to the attention over the
sequence bit for bit, and the trainer's log-prob pass scoring the same sequences at batch 1
and batch 8 (verl #6280's measurement) with 0 differing tokens, in float32 and bfloat16."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models import invariant
from hybridjax.models.attention import attention_mask, dot_product_attention
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.training.batch import make_batch
from hybridjax.training.forward import model_log_probs

DTYPES = ("float32", "bfloat16")
MODEL = ModelConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attention_bias=True, batch_invariant=True,
)  # fmt: skip


def _first_row_at(fn, x, counts=(1, 3, 16, 17, 40)):
    """fn's first output row when called on the first n rows of x, for each n."""
    return [np.asarray(jax.jit(fn)(x[:n])[0].astype(jnp.float32)) for n in counts]


@pytest.mark.parametrize("dtype", DTYPES)
def test_primitives_give_a_row_the_same_bits_at_any_row_count(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((40, 96)), dtype)
    w = jnp.asarray(0.1 * rng.standard_normal((96, 48)), dtype)
    for fn in (
        lambda x: invariant.matmul(x, w),
        lambda x: invariant.matmul(x, w, jnp.float32),
        lambda x: invariant.rms_norm(x, w[:, 0], 1e-6),
        lambda x: invariant.log_softmax(x.astype(jnp.float32) * 3),
    ):
        first, *others = _first_row_at(fn, x)
        for other in others:
            np.testing.assert_array_equal(other, first)
    # and the values are the plain operations'
    np.testing.assert_allclose(
        np.asarray(invariant.matmul(x, w, jnp.float32)),
        np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32)),
        rtol=1e-5,
        atol=1e-5,
    )


def _attention_inputs(dtype, b=3, t=21, h=4, kv=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dtype) for n in (h, kv, kv))
    lengths = np.array([t, 13, 6])
    valid = np.arange(t)[None] < lengths[:, None]  # right-padded
    positions = np.where(valid, np.arange(t)[None], 0)
    return q, k, v, jnp.asarray(positions), jnp.asarray(valid)


def test_bfloat16_tiles_are_not_converted_whole_at_every_step():
    # XLA:CPU computes a bfloat16 loop output's per-step update in float32: the compiled
    # loop must carry the tiles as bits, not a float32 copy of all 64 tiles
    x = jax.ShapeDtypeStruct((64 * invariant.TILE_ROWS, 32), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 48), jnp.bfloat16)
    hlo = jax.jit(invariant.matmul).lower(x, w).compile().as_text()
    assert f"f32[64,{invariant.TILE_ROWS},48]" not in hlo
    assert f"u16[64,{invariant.TILE_ROWS},48]" in hlo


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv, d", [(2, 8), (4, 64)], ids=["gqa", "mha-64"])
def test_attention_over_pages_equals_attention_over_the_sequence_bit_for_bit(dtype, kv, d):
    """The engine's paged read (shuffled pages of 4 tokens, the pool holding other rows'
    keys too) and the trainer's read by position give the same bits; both are attention
    (float32 tolerance against the dense reference); left padding changes nothing. One kv
    head per query head at D = 64 is where keys shared by a tile gave other bits."""
    q, k, v, positions, valid = _attention_inputs(dtype, kv=kv, d=d)
    b, t, kv, d = k.shape
    page, width = 4, 6
    rng = np.random.default_rng(1)
    table = rng.permutation(b * width).reshape(b, width).astype(np.int32)
    pools = []
    for x in (k, v):
        pool = jnp.asarray(rng.standard_normal((kv, b * width, page, d)), dtype)  # junk
        pos = np.arange(t)
        at = table[:, pos // page]
        pools.append(pool.at[:, at, pos % page].set(jnp.moveaxis(x, 2, 0)))
    seq = invariant.self_attention(q, k, v, positions, valid)
    paged = invariant.paged_attention(q, *pools, jnp.asarray(table), positions)
    m = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(paged)[m], np.asarray(seq)[m])
    mask = attention_mask(positions, positions, valid)
    want = dot_product_attention(q, k, v, mask)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(
        np.asarray(seq, np.float32)[m], np.asarray(want, np.float32)[m], rtol=tol, atol=tol
    )
    # the same rows left-padded: keys are read by position, so the same bits
    shift = [t - int(n) for n in np.asarray(valid).sum(-1)]
    roll = lambda x: jnp.stack([jnp.roll(x[i], s, axis=0) for i, s in enumerate(shift)])  # noqa: E731
    left = invariant.self_attention(roll(q), roll(k), roll(v), roll(positions), roll(valid))
    np.testing.assert_array_equal(np.asarray(roll(seq))[np.asarray(roll(valid))],
                                  np.asarray(left)[np.asarray(roll(valid))])  # fmt: skip


def _rows(seed=0, rows=8, prompt=7, response=9, vocab=96):
    """8 rows of left-padded prompts and right-padded responses of varied lengths."""
    rng = np.random.default_rng(seed)
    p_len, r_len = rng.integers(1, prompt + 1, rows), rng.integers(1, response + 1, rows)
    p_mask = np.arange(prompt)[None] >= prompt - p_len[:, None]
    r_mask = np.arange(response)[None] < r_len[:, None]
    batch = make_batch(
        jnp.asarray(rng.integers(1, vocab, (rows, prompt)) * p_mask),
        jnp.asarray(p_mask),
        jnp.asarray(rng.integers(1, vocab, (rows, response)) * r_mask),
        jnp.asarray(r_mask),
    )
    fields = {
        "input_ids": jnp.concatenate([batch.prompts, batch.responses], axis=1),
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
    }
    return fields, r_mask


def batch_1_vs_batch_8(config: ModelConfig, temperature: float = 0.7):
    """(tokens whose log-prob differs between scoring the 8 rows together and one at a time,
    tokens scored, max |Δ log p|) through the trainer's log-prob pass (`model_log_probs`)."""
    model = CausalLM(config, nnx.Rngs(0))
    score = jax.jit(lambda f: model_log_probs(model, f, temperature)[0])
    fields, mask = _rows()
    together = np.asarray(score(fields))
    alone = np.concatenate([np.asarray(score({k: x[i : i + 1] for k, x in fields.items()}))
                            for i in range(mask.shape[0])])  # fmt: skip
    delta = np.abs(together - alone)[mask]
    return int((delta > 0).sum()), int(mask.sum()), float(delta.max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_trainer_log_probs_at_batch_1_and_batch_8_are_equal(dtype):
    differing, scored, _ = batch_1_vs_batch_8(dataclasses.replace(MODEL, dtype=dtype))
    assert scored > 30 and differing == 0


def test_parity_mode_computes_the_model_of_the_default_mode():
    """Same weights, float32: parity mode's log-probs are the default path's to rounding."""
    fields, mask = _rows(seed=1)
    out = []
    for on in (True, False):
        model = CausalLM(dataclasses.replace(MODEL, batch_invariant=on), nnx.Rngs(0))
        out.append(np.asarray(jax.jit(lambda f, m=model: model_log_probs(m, f, 1.0)[0])(fields)))
    np.testing.assert_allclose(out[0][mask], out[1][mask], atol=2e-5)


def test_packed_buffers_and_experts_are_refused():
    model = CausalLM(MODEL, nnx.Rngs(0))
    ids = jnp.ones((1, 4), jnp.int32)
    segments = (jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="use_remove_padding"):
        model.model(ids, jnp.arange(4)[None], ids > 0, segments=segments)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        dataclasses.replace(
            MODEL, family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16,
        )  # fmt: skip
