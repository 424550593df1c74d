"""Incremental decoding against `DenseKVCache` equals the full forward at every position."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_testing import max_valid_diff, our_logits

from hybridjax.models import DenseKVCache
from hybridjax.models.hf_io import load_pretrained

DECODE_TOL = 1e-5


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral", "qwen3", "qwen3_moe"])
def test_prefill_then_token_by_token_equals_full_forward(family, hf_checkpoints, padded_batch):
    """Prefill the first 7 columns (row 3 is all padding there), then one column per call.

    Mistral's window (8) is shorter than the sequences (20), so the cache's window is tested too.
    """
    model = load_pretrained(hf_checkpoints[family][0])
    ids, mask, positions = (jnp.asarray(x) for x in padded_batch)
    full = our_logits(model, padded_batch)

    b, t = ids.shape
    cache = DenseKVCache.create(model.config, b, max_len=t)
    decode = nnx.jit(lambda m, *args: m.decode(*args))  # two shapes: prefill and one column
    prefill = 7
    step_logits, cache = decode(
        model, ids[:, :prefill], positions[:, :prefill], mask[:, :prefill], cache
    )
    pieces = [np.asarray(step_logits)]
    for col in range(prefill, t):
        sl = slice(col, col + 1)
        step_logits, cache = decode(model, ids[:, sl], positions[:, sl], mask[:, sl], cache)
        pieces.append(np.asarray(step_logits))
    incremental = np.concatenate(pieces, axis=1)

    assert incremental.shape == full.shape
    assert max_valid_diff(incremental, full, mask) <= DECODE_TOL
    # Every valid token, and nothing else, was written to the cache.
    np.testing.assert_array_equal(np.asarray(cache.valid).sum(axis=1), np.asarray(mask).sum(axis=1))
