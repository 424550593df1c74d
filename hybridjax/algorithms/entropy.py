"""Token entropy from logits, computed chunk by chunk along the sequence.

A B×T×V softmax for an LLM vocabulary is large (8×2048×152k floats = 10 GB). Computing the
entropy of all tokens at once would hold the probabilities next to the logits, and autodiff
would keep them for the backward pass. Here a `lax.scan` walks over chunks of `chunk_size`
positions; each chunk is rematerialised (`jax.checkpoint`) in the backward pass, so at most one
chunk's softmax is alive at a time. The batch axis is never reshaped, so a batch-sharded (or
vocab-sharded) logits array keeps its sharding.

Chunks bound the temporaries to one chunk's softmax (forward) and its recomputation
(backward), whatever the backend fuses; XLA's CPU backend fuses the one-piece formula without
temporaries, so on CPU a `chunk_size` ≥ T (one piece) costs less. The memory measured per
chunk size is in docs/benchmarks.md ("Measurements behind choices in the code").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 256  # positions per chunk


def _entropy_of(logits_BxCxV: jax.Array) -> jax.Array:
    logits = logits_BxCxV.astype(jnp.float32)
    lse_BxC = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse_BxC[..., None])
    return lse_BxC - jnp.sum(probs * logits, axis=-1)


def entropy_from_logits(logits_BxTxV: jax.Array, chunk_size: int = DEFAULT_CHUNK_SIZE) -> jax.Array:
    """H_bt = logsumexp(z) − Σ_v softmax(z)_v·z_v, float32 B×T (nats), differentiable.

    Apply the sampling temperature to the logits first if the entropy should match the sampler.
    `chunk_size` ≥ 1; the last chunk overlaps the previous one when T is not a multiple of it.
    Source: verl `entropy_from_logits` (`verl/utils/torch_functional.py`).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, _ = logits_BxTxV.shape
    chunk = min(chunk_size, length)
    if chunk == length:
        return _entropy_of(logits_BxTxV)

    # The slice happens inside the checkpointed function, so the backward pass keeps only the
    # (loop-invariant) full logits and the chunk start, never a stack of sliced chunks.
    @jax.checkpoint
    def chunk_entropy(logits, start):
        return _entropy_of(jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=1))

    def step(entropy_BxT, index):
        start = jnp.minimum(index * chunk, length - chunk)
        entropy_BxC = chunk_entropy(logits_BxTxV, start)
        return jax.lax.dynamic_update_slice_in_dim(entropy_BxT, entropy_BxC, start, 1), None

    init_BxT = jnp.zeros((batch, length), jnp.float32)
    entropy_BxT, _ = jax.lax.scan(step, init_BxT, jnp.arange(math.ceil(length / chunk)))
    return entropy_BxT
