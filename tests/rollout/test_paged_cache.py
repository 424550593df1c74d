"""The paged KV cache against the full forward: prefill and every decode step, mixed lengths,
pages scattered through the pool, a row that stops early, a sliding window."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rollout_testing import TINY, make_model

from hybridjax.rollout.decode_attention import paged_attention_jnp
from hybridjax.rollout.paged_cache import PagedKVCache, copy_pages, write_pages

PAGE = 4
LENGTHS = (5, 9, 2)  # prompt lengths of the three rows
STEPS = 6


def _scattered_tables(rows: int, pages_per_row: int, num_pages: int, seed=0) -> np.ndarray:
    perm = np.random.default_rng(seed).permutation(num_pages)[: rows * pages_per_row]
    return perm.reshape(rows, pages_per_row).astype(np.int32)


def _check_against_full_forward(model):
    config = model.config
    rng = np.random.default_rng(0)
    total = max(LENGTHS) + STEPS
    seqs = rng.integers(0, config.vocab_size, size=(len(LENGTHS), total))
    pages_per_row = -(-total // PAGE)
    table = _scattered_tables(len(LENGTHS), pages_per_row, 40)
    k, v = PagedKVCache.create_pool(config, 40, PAGE)
    cache = PagedKVCache(k, v, jnp.asarray(table), mode="prefill",
                         sliding_window=config.sliding_window)  # fmt: skip

    # Prefill: the prompts right-padded to the longest.
    t = max(LENGTHS)
    mask = np.arange(t)[None, :] < np.array(LENGTHS)[:, None]
    positions = np.broadcast_to(np.arange(t), mask.shape)
    graphdef, state = nnx.split(model)
    decode = jax.jit(lambda s, *args: nnx.merge(graphdef, s).decode(*args))
    logits, cache = decode(state, jnp.asarray(seqs[:, :t]), positions, mask, cache)
    # Causal: the full forward's logits at position p are those of the prefix 0..p.
    full = model(jnp.asarray(seqs), jnp.ones(seqs.shape, bool))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(logits[b, :n], full[b, :n], atol=1e-5, rtol=0)

    # Decode: row b feeds token L_b + j at position L_b + j; row 2 stops after 3 steps.
    cache = dataclasses.replace(cache, mode="decode")
    for j in range(STEPS):
        pos = np.array(LENGTHS) + j
        active = np.array([True, True, j < 3])
        tok = seqs[np.arange(len(LENGTHS)), pos]
        logits, cache = decode(state, tok[:, None], pos[:, None], active[:, None], cache)
        for b in np.flatnonzero(active):
            np.testing.assert_allclose(logits[b, 0], full[b, pos[b]], atol=1e-5, rtol=0)


def test_paged_decode_equals_full_forward_at_every_step():
    _check_against_full_forward(make_model())


def test_paged_decode_with_sliding_window_equals_full_forward():
    _check_against_full_forward(make_model(dataclasses.replace(TINY, sliding_window=3)))


def test_write_pages_places_tokens_and_drops_masked_ones():
    pool = jnp.zeros((1, 4, 2, 1))  # K=1, 4 pages of 2 slots, D=1
    table = jnp.array([[3, 1]])
    new = jnp.array([[1.0, 2.0, 3.0]]).reshape(1, 3, 1, 1)
    out = write_pages(pool, new, table, jnp.array([[0, 1, 2]]), jnp.array([[True, True, False]]))
    expect = np.zeros((4, 2))
    expect[3] = [1.0, 2.0]  # positions 0, 1 → page 3; position 2 masked: page 1 untouched
    np.testing.assert_array_equal(out[0, :, :, 0], expect)


def test_copy_pages_copies_and_skips_out_of_bounds():
    k = (jnp.arange(8.0).reshape(1, 4, 2, 1),)
    k2, _ = copy_pages(k, k, jnp.array([1, 0]), jnp.array([3, 4]))
    np.testing.assert_array_equal(k2[0][0, :, :, 0], [[0, 1], [2, 3], [4, 5], [2, 3]])


def test_jnp_gather_equals_dense_softmax():
    """One query, keys at positions 0..5 on two scattered pages: a hand-built softmax."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 1, 1, 2)).astype(np.float32)
    keys = rng.normal(size=(6, 2)).astype(np.float32)
    vals = rng.normal(size=(6, 2)).astype(np.float32)
    k = np.zeros((1, 5, 4, 2), np.float32)
    v = np.zeros((1, 5, 4, 2), np.float32)
    k[0, 2], k[0, 0, :2] = keys[:4], keys[4:]
    v[0, 2], v[0, 0, :2] = vals[:4], vals[4:]
    out = paged_attention_jnp(q, k, v, jnp.array([[2, 0]]), jnp.array([[5]]))
    w = jax.nn.softmax(keys @ q[0, 0, 0] / np.sqrt(2))
    np.testing.assert_allclose(out[0, 0, 0], w @ vals, atol=1e-6)
