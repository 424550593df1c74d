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
the log-sum-exp. The arithmetic is the dense path's (every block is computed, masked ones
included): the saving is memory, not work. Being plain `jnp`, it runs on every backend and its
numerics are tested on CPU against the dense path; it is the GPU and TPU path of
`hybridjax.models.attention.self_attention` (see there and the README for why not cuDNN,
a Pallas kernel or splash attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCK = 128
NEG_INF = -1e30


def visible(
    segment_ids_q, prefix_ids_q, positions_q, index_q, segment_ids_k, positions_k, index_k,
    valid_k, window,
):  # fmt: skip
    """Boolean B×Tq×Tk: query i sees key j iff j is valid, j ≤ i by buffer index, j is in i's
    segment or i's prefix segment, and (with a window) pos_i − pos_j < window. The same rule
    as `attention.packed_attention_mask`, for one block of keys. Args are B×Tq (queries) and
    B×Tk (keys); `index_*` are buffer indices (Tq / Tk,)."""
    seg_k = segment_ids_k[:, None, :]
    same = (seg_k == segment_ids_q[:, :, None]) | (seg_k == prefix_ids_q[:, :, None])
    mask = same & (index_k[None, None, :] <= index_q[None, :, None]) & valid_k[:, None, :]
    if window is not None:
        mask &= positions_q[:, :, None] - positions_k[:, None, :] < window
    return mask


def _blocks(x, block):
    """B×S×… → (S/block)×B×block×… (S a multiple of `block`)."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _key_blocks(k, v, ids, block):
    """Key-side inputs split into blocks of `block` keys, the last one padded with invalid keys."""
    segment_ids, _, positions, valid = ids
    pad = -k.shape[1] % block
    widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
    k, v, segment_ids, positions, valid = (
        jnp.pad(x, widths(x)) for x in (k, v, segment_ids, positions, valid)
    )
    index = jnp.arange(k.shape[1]).reshape(-1, block)
    return tuple(_blocks(x, block) for x in (k, v, segment_ids, positions, valid)) + (index,)


def _logits_and_mask(q, ids, blk, window, scale):
    """Scaled float32 logits B×K×T×G×block of every query against key block `blk`, and its
    mask broadcast to that shape."""
    segment_ids, prefix_ids, positions, _ = ids
    kb, _, seg_k, pos_k, valid_k, index_k = blk
    s = jnp.einsum("btkgd,bskd->bktgs", q, kb, preferred_element_type=jnp.float32) * scale
    index_q = jnp.arange(q.shape[1])
    mask = visible(
        segment_ids, prefix_ids, positions, index_q, seg_k, pos_k, index_k, valid_k, window
    )
    return s, mask[:, None, :, None, :]


def _forward(q, k, v, ids, window, block):
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scale = d**-0.5

    def step(carry, blk):
        m, l, acc = carry
        s, mask = _logits_and_mask(q, ids, blk, window, scale)
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG_INF), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum(
            "bktgs,bskd->bktgd", p.astype(v.dtype), blk[1], preferred_element_type=jnp.float32
        )
        return (m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv), None

    stats = jnp.full((b, kv, t, h // kv), NEG_INF, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros((b, kv, t, h // kv, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, _key_blocks(k, v, ids, block))
    has_key = l > 0  # a query with no visible key (an empty slot) gets 0, never NaN
    out = (acc / jnp.where(has_key, l, 1.0)[..., None]).astype(q.dtype)
    lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), 0.0)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, ids, window, block):
    return _forward(q, k, v, ids, window, block)[0]


def _attention_fwd(q, k, v, ids, window, block):
    out, lse = _forward(q, k, v, ids, window, block)
    return out, (q, k, v, ids, out, lse)


def _attention_bwd(window, block, residuals, d_out):
    q, k, v, ids, out, lse = residuals
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scale = d**-0.5
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1)  # D = rowsum(dO ∘ O)

    def step(dq, blk):
        kb, vb = blk[0], blk[1]
        s, mask = _logits_and_mask(qg, ids, blk, window, scale)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum("bktgs,bktgd->bskd", p, d_out)
        dp = jnp.einsum("bktgd,bskd->bktgs", d_out, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bktgs,bskd->bktgd", ds, kb, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bktgs,btkgd->bskd", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

    dq0 = jnp.zeros((b, kv, t, h // kv, d), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(step, dq0, _key_blocks(k, v, ids, block))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, *x.shape[3:])[:, : k.shape[1]]
    dq = dq.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), ids)  # int/bool ids
    return dq, unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), zeros


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
    block: int = DEFAULT_BLOCK,
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
      block: keys per scan step (static); scratch is O(B·H·T·block).
    Returns:
      B×K×T×G×D in q's dtype (query head h = k·G + g), the layout of
      `attention.grouped_attention`. A query that sees no key gets 0.
    """
    ids = (segment_ids_BxT, prefix_ids_BxT, positions_BxT, valid_BxT.astype(bool))
    block = max(min(block, k_BxTxKxD.shape[1]), 1)
    return _attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, ids, sliding_window, block)
