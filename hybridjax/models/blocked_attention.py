"""Self-attention whose memory grows with tokens, not tokens²: the mask is computed per key
block from per-token ids, and the softmax is accumulated online over the blocks.

This is the memory-efficient attention of Rabe & Staats 2021 ("Self-attention does not need
O(n²) memory") with the forward and backward passes of FlashAttention-2 (Dao 2023, Algorithms
1 and 2) written as two `lax.scan`s over key blocks of `block` tokens, in `jnp`:

* forward: for each key block, logits of every query against the block (float32,
  B×H×T×block), the mask of that block (`visible`), and the running maximum m, denominator l
  and numerator of the softmax; the output is numerator / l, and the log-sum-exp m + log l is
  kept for the backward;
* backward (a `jax.custom_vjp`): for each key block, the probabilities are recomputed from the
  kept log-sum-exp, dK and dV of the block are produced and dQ is accumulated, with
  D = rowsum(dO ∘ O).

Nothing of size T×T exists at any point, neither the mask nor the logits nor anything saved
for the backward: scratch is O(B·H·T·block), residuals are q, k, v, the ids, the output and
the log-sum-exp. The queries are split into chunks of QUERY_CHUNK tokens (at most
MAX_QUERY_CHUNKS) and a chunk scans only the key blocks up to its own last token, since keys
after a query are masked (causal by index): that skips about half of the logits, softmax and
products. Masked blocks below the diagonal are still computed (the shapes are static). Being
plain `jnp`, it runs on every backend and its numerics are tested on CPU against the dense
path; it is the GPU and TPU path of `hybridjax.models.attention.self_attention` (see there and
docs/packing.md for why not cuDNN, a Pallas kernel or splash attention).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCK = 128  # keys per scan step
QUERY_CHUNK = 512  # queries per chunk (each chunk scans the key blocks up to its end)
MAX_QUERY_CHUNKS = 8  # a scan pair per chunk is compiled: bounds the program's size
NEG_INF = -1e30


def visible(q_ids, k_ids, q_index, k_index, window):
    """Boolean B×Tq×Tk: query i sees key j iff j is valid, j ≤ i by buffer index, j is in i's
    segment or i's prefix segment, and (with a window) pos_i − pos_j < window: the rule of
    `attention.packed_attention_mask`, for a block of queries and keys.

    q_ids: (segment ids, prefix ids, positions), each B×Tq.  k_ids: (segment ids, positions,
    valid), each B×Tk.  q_index, k_index: buffer indices, (Tq,) and (Tk,)."""
    seg_q, prefix_q, pos_q = q_ids
    seg_k, pos_k, valid_k = (x[:, None, :] for x in k_ids)
    same = (seg_k == seg_q[:, :, None]) | (seg_k == prefix_q[:, :, None])
    mask = same & (k_index[None, None, :] <= q_index[None, :, None]) & valid_k
    if window is not None:
        mask &= pos_q[:, :, None] - pos_k < window
    return mask


def _key_blocks(k, v, k_ids, block):
    """Keys, values, key ids and buffer indices split into blocks of `block` keys on a new
    leading axis (the loops'), the last block padded with invalid keys."""
    pad = -k.shape[1] % block
    index = jnp.arange(k.shape[1] + pad)
    arrays = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (k, v, *k_ids)]
    blocks = [jnp.moveaxis(x.reshape(x.shape[0], -1, block, *x.shape[2:]), 1, 0) for x in arrays]
    return (*blocks, index.reshape(-1, block))


def _logits_and_mask(q, q_ids, q_index, blocks, j, window):
    """Scaled float32 logits B×K×Tq×G×block of the queries (B×Tq×K×G×D, buffer indices
    q_index) against key block j, the block's mask broadcast to that shape, and the block."""
    kb, vb, seg_k, pos_k, valid_k, k_index = (x[j] for x in blocks)
    s = jnp.einsum("btkgd,bskd->bktgs", q, kb, preferred_element_type=jnp.float32)
    mask = visible(q_ids, (seg_k, pos_k, valid_k), q_index, k_index, window)
    return s * q.shape[-1] ** -0.5, mask[:, None, :, None, :], kb, vb


def _grouped(q, kv):
    b, t, h, d = q.shape
    return q.reshape(b, t, kv, h // kv, d)


def _chunks(q, q_ids, bounds):
    """(lo, hi, the queries [lo, hi) B×Tc×K×G×D, their ids) per query chunk."""
    for lo, hi in itertools.pairwise(bounds):
        yield lo, hi, q[:, lo:hi], tuple(x[:, lo:hi] for x in q_ids)


def _forward(q, k, v, q_ids, k_ids, window, block, bounds):
    blocks = _key_blocks(k, v, k_ids, block)
    outs, lses = [], []
    for lo, hi, qc, ids in _chunks(_grouped(q, k.shape[2]), q_ids, bounds):
        q_index = lo + jnp.arange(hi - lo)

        def step(j, carry, qc=qc, ids=ids, q_index=q_index):
            row_max, denom, numer = carry
            s, mask, _, vb = _logits_and_mask(qc, ids, q_index, blocks, j, window)
            new_max = jnp.maximum(row_max, jnp.max(jnp.where(mask, s, NEG_INF), axis=-1))
            p = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
            alpha = jnp.exp(row_max - new_max)
            pv = jnp.einsum(
                "bktgs,bskd->bktgd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32
            )
            return new_max, alpha * denom + jnp.sum(p, axis=-1), alpha[..., None] * numer + pv

        b, t, kv, g, d = qc.shape
        stats = jnp.full((b, kv, t, g), NEG_INF, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((b, kv, t, g, d), jnp.float32))
        # the chunk [lo, hi) sees the key blocks up to its end: keys after hi are masked
        row_max, denom, numer = jax.lax.fori_loop(0, -(-hi // block), step, init)
        has_key = denom > 0  # a query with no visible key (an empty slot) gets 0, never NaN
        denom = jnp.where(has_key, denom, 1.0)
        outs.append((numer / denom[..., None]).astype(q.dtype))
        lses.append(jnp.where(has_key, row_max + jnp.log(denom), 0.0))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, q_ids, k_ids, window, block, bounds):
    return _forward(q, k, v, q_ids, k_ids, window, block, bounds)[0]


def _attention_fwd(q, k, v, q_ids, k_ids, window, block, bounds):
    out, lse = _forward(q, k, v, q_ids, k_ids, window, block, bounds)
    return out, (q, k, v, q_ids, k_ids, out, lse)


def _attention_bwd(window, block, bounds, residuals, d_out):
    q, k, v, q_ids, k_ids, out, lse = residuals
    blocks = _key_blocks(k, v, k_ids, block)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # D = rowsum(dO ∘ O)
    # dK, dV accumulate over the chunks in one buffer each (blocks × B × block × K × D)
    dk = dv = jnp.zeros(blocks[0].shape, jnp.float32)
    dqs = []
    for lo, hi, qc, ids in _chunks(_grouped(q, k.shape[2]), q_ids, bounds):
        q_index = lo + jnp.arange(hi - lo)
        do, dl, lse_c = d_out[:, :, lo:hi], delta[:, :, lo:hi], lse[:, :, lo:hi]

        def step(j, carry, qc=qc, ids=ids, q_index=q_index, do=do, dl=dl, lse_c=lse_c):
            dq, dk, dv = carry
            s, mask, kb, vb = _logits_and_mask(qc, ids, q_index, blocks, j, window)
            p = jnp.where(mask, jnp.exp(s - lse_c[..., None]), 0.0)
            dp = jnp.einsum("bktgd,bskd->bktgs", do, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - dl[..., None]) * q.shape[-1] ** -0.5
            dq = dq + jnp.einsum("bktgs,bskd->bktgd", ds, kb, preferred_element_type=jnp.float32)
            dk = dk.at[j].add(jnp.einsum("bktgs,btkgd->bskd", ds, qc))
            dv = dv.at[j].add(jnp.einsum("bktgs,bktgd->bskd", p, do))
            return dq, dk, dv

        dq0 = jnp.zeros(do.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, -(-hi // block), step, (dq0, dk, dv))
        dqs.append(dq)
    b, s = k.shape[:2]
    unblock = lambda x, like: (
        jnp.moveaxis(x, 0, 1).reshape(b, -1, *like.shape[2:])[:, :s].astype(like.dtype)
    )
    dq = jnp.concatenate(dqs, axis=2).transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
    ids_zero = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), (q_ids, k_ids))
    return dq, unblock(dk, k), unblock(dv, v), *ids_zero


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    segment_ids_BxT: jax.Array,
    prefix_ids_BxT: jax.Array,
    positions_BxT: jax.Array,
    valid_BxT: jax.Array,
    sliding_window: int | None = None,
    block: int | None = None,
) -> jax.Array:
    """Softmax(q·kᵀ/√D)·v of T tokens over themselves under the packed mask (`visible`),
    H query heads sharing K = H/G key/value heads (GQA); differentiable in q, k, v.

    Args:
      q_BxTxHxD, k_BxTxKxD, v_BxTxKxD: queries, keys, values (any float dtype; logits,
        softmax statistics and gradient accumulators are float32).
      segment_ids_BxT, prefix_ids_BxT: int32 segment of each token and the segment its
        queries also see (a response's shared prompt; a token's own segment otherwise).
      positions_BxT: int32 position ids (used by the sliding window only).
      valid_BxT: bool, False on empty slots (never seen as keys).
      sliding_window: keys at most this many positions back, or None.
      block: keys per scan step (static, default DEFAULT_BLOCK); scratch is O(B·H·T·block).
    Returns:
      B×K×T×G×D in q's dtype (query head h = k·G + g), the layout of
      `attention.grouped_attention`. A query that sees no key gets 0.
    """
    t = q_BxTxHxD.shape[1]
    block = max(min(block or DEFAULT_BLOCK, t), 1)
    n = max(min(MAX_QUERY_CHUNKS, -(-t // QUERY_CHUNK)), 1)
    bounds = tuple(sorted({min(-(-t * i // n // block) * block, t) for i in range(n + 1)}))
    q_ids = (segment_ids_BxT, prefix_ids_BxT, positions_BxT)
    k_ids = (segment_ids_BxT, positions_BxT, valid_BxT.astype(bool))
    return _attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, q_ids, k_ids, sliding_window, block, bounds)
