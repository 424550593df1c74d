"""Sampling: hand-computed truncation and log-probs, greedy rows, the allocator, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from hybridjax.rollout.allocator import OutOfPagesError, PageAllocator
from hybridjax.rollout.config import RolloutConfig, SamplingParams, run_batch_seqs
from hybridjax.rollout.sampling import (
    first_argmax,
    inverse_cdf_sample,
    sample_tokens,
    step_uniforms,
    support_threshold,
    truncate_logits,
)


def uniforms(seed: int, rows: int) -> jax.Array:
    return jax.random.uniform(jax.random.PRNGKey(seed), (rows,))


PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        (-1, 1.0, 4),
        (1, 1.0, 1),
        (3, 1.0, 3),
        (-1, 0.7, 2),
        (-1, 0.81, 3),
        (-1, 0.5, 1),
        (2, 0.9, 2),
    ],
)
def test_truncate_keeps_top_k_then_smallest_top_p_set(top_k, top_p, kept):
    # top_p 0.7: 0.5 < 0.7, 0.5 + 0.3 ≥ 0.7 → {0, 1}; top_p 0.81 → {0, 1, 2}.
    out = truncate_logits(LOGITS, jnp.array([top_k]), jnp.array([top_p], jnp.float32))
    assert np.isfinite(out[0]).tolist() == [True] * kept + [False] * (4 - kept)


def test_support_threshold_sits_between_the_kept_and_the_dropped():
    """top-p 0.7 keeps {0, 1}: τ halfway between ln 0.3 and ln 0.15; top-k 1 with a tie at
    the top keeps both tied tokens: τ = (1 + 0) / 2; nothing dropped: −inf."""
    tau = support_threshold(LOGITS, jnp.array([-1]), jnp.array([0.7], jnp.float32))
    np.testing.assert_allclose(tau, [(np.log(0.3) + np.log(0.15)) / 2], rtol=1e-6)
    tied = jnp.array([[1.0, 1.0, 0.0]])
    np.testing.assert_allclose(support_threshold(tied, jnp.array([1]), jnp.ones(1)), [0.5])
    assert np.isneginf(support_threshold(tied, jnp.array([-1]), jnp.ones(1)))[0]


def test_log_prob_is_of_the_renormalised_distribution():
    keys = uniforms(0, 64)
    logits = jnp.repeat(LOGITS, 64, axis=0)
    ones = jnp.ones(64)
    tok, lp, _ = sample_tokens(logits, keys, ones, jnp.full(64, -1), 0.7 * ones, True)
    assert set(np.asarray(tok).tolist()) == {0, 1}
    expect = np.log(PROBS[np.asarray(tok)] / 0.8)  # kept mass 0.8
    np.testing.assert_allclose(lp, expect, rtol=1e-5)


def test_temperature_log_prob_and_greedy_rows():
    keys = uniforms(1, 2)
    logits = jnp.repeat(LOGITS, 2, axis=0)
    temperature = jnp.array([0.0, 2.0])
    tok, lp, _ = sample_tokens(logits, keys, temperature, jnp.array([1, -1]), jnp.ones(2), True)
    assert int(tok[0]) == 0
    np.testing.assert_allclose(lp[0], np.log(0.5), rtol=1e-6)  # greedy: T = 1, not truncated
    scaled = np.sqrt(PROBS) / np.sqrt(PROBS).sum()  # p^(1/T) renormalised, T = 2
    np.testing.assert_allclose(lp[1], np.log(scaled[int(tok[1])]), rtol=1e-5)


def test_sampling_follows_the_distribution():
    keys = uniforms(2, 4000)
    logits = jnp.repeat(LOGITS, 4000, axis=0)
    tok, *_ = sample_tokens(logits, keys, jnp.ones(4000), jnp.full(4000, -1), jnp.ones(4000), False)
    freq = np.bincount(np.asarray(tok), minlength=4) / 4000
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_inverse_cdf_matches_a_searchsorted_reference():
    # V = 100 is not a multiple of the 64-token block; a third of the tokens have probability 0.
    rng = np.random.default_rng(0)
    probs = rng.random((16, 100)) * (rng.random((16, 100)) > 0.3)
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    u = rng.random(16).astype(np.float32)
    u[:2] = [0.0, np.nextafter(np.float32(1), np.float32(0))]  # both ends of [0, 1)
    got = np.asarray(inverse_cdf_sample(jnp.asarray(u), jnp.asarray(probs)))
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    expect = [np.searchsorted(c, x * c[-1], side="right") for c, x in zip(cdf, u, strict=True)]
    expect = np.minimum(expect, [np.flatnonzero(p)[-1] for p in probs])
    np.testing.assert_array_equal(got, expect)
    assert (probs[np.arange(16), got] > 0).all()


def test_first_argmax_takes_the_first_maximum():
    x = jnp.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    np.testing.assert_array_equal(first_argmax(x), jnp.argmax(x, axis=-1))


def test_step_uniforms_depend_only_on_the_token_index():
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    u = step_uniforms(keys, jnp.array([0, 5]), 4)
    later = step_uniforms(keys, jnp.array([2, 7]), 2)  # a call that starts two tokens later
    np.testing.assert_array_equal(u[:, 2:], later)
    one = jax.random.uniform(jax.random.fold_in(keys[1], 6), dtype=jnp.float32)
    assert float(u[1, 1]) == float(one)


def test_allocator_free_list_and_refcounts():
    a = PageAllocator(4)
    pages = a.allocate(3)
    assert pages == [0, 1, 2] and a.num_free == 1
    a.share(pages[:2])
    a.release(pages)
    assert a.num_free == 2 and a.refcount(0) == 1  # 0 and 1 still shared once
    a.release(pages[:2])
    assert a.num_free == 4
    with pytest.raises(OutOfPagesError, match="asked for 5 pages, 4 free"):
        a.allocate(5)
    with pytest.raises(ValueError, match="released more often"):
        a.release([3])


def test_configs_from_verl_keys():
    rollout = ConfigDict(
        dict(n=4, temperature=0.7, top_k=-1, top_p=0.95, do_sample=True, prompt_length=64,
             response_length=32, gpu_memory_utilization=0.4, num_pages=-1, page_size=8,
             max_num_seqs=16, val_kwargs=dict(n=1, temperature=0.0, top_k=-1, top_p=1.0,
                                              do_sample=False))
    )  # fmt: skip
    sp = SamplingParams.from_config(rollout, seed=3)
    assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (4, 0.7, 0.95, 32, 3)
    val = SamplingParams.from_config(rollout, validate=True)
    assert (val.n, val.temperature) == (1, 0.0)
    rc = RolloutConfig.from_config(rollout)
    assert (rc.num_pages, rc.page_size, rc.max_num_seqs, rc.max_seq_len) == (None, 8, 16, 96)
    assert rc.pages_per_seq == 12  # positions 0..94
    assert rc.default_num_pages == 16 * 12
    # without memory statistics the pool holds the slots a rollout can fill, at full length
    assert RolloutConfig.from_config(rollout, batch_seqs=6).default_num_pages == 6 * 12
    assert RolloutConfig.from_config(rollout, batch_seqs=100).default_num_pages == 16 * 12
    with pytest.raises(ValueError, match="batch_seqs"):
        RolloutConfig(batch_seqs=0)
    with pytest.raises(ValueError, match="attention_impl"):
        RolloutConfig(attention_impl="flash")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_run_batch_seqs_is_the_larger_generation_call():
    from hybridjax.config.schema import base_config

    cfg = base_config()
    cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n = 8, 4
    assert run_batch_seqs(cfg) == 32  # validation: batches of train_batch_size, n = 1
    cfg.data.val_batch_size, cfg.actor_rollout_ref.rollout.val_kwargs.n = 20, 2
    assert run_batch_seqs(cfg) == 40
