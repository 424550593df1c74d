"""Batch-invariant primitives: results that do not depend on how many rows share a call.

XLA:CPU picks a dot's algorithm and a reduction's vectorisation by the shape of the whole
call: a row of `x @ w` rounds differently at 1 row (a matrix-vector product) than at 16, and
a row's RMSNorm or log-softmax differently at 1–8 rows than at 16 (measured: up to every
element of the row at float32, and the sampled token's log-prob at float32 and bfloat16).
So the engine, which runs a sequence among however many other rows are decoding, and the
trainer, which scores it in a batch of another size and layout, disagree in the last bits.

Parity mode (`ModelConfig.batch_invariant`, config `actor_rollout_ref.model.batch_invariant`)
routes every such operation of the decoder through this module, where it runs on tiles of a
fixed TILE_ROWS rows (`map_rows`: the rows flattened, padded, and mapped one tile at a time
with `lax.map`), so every compiled kernel sees the same shape whatever the batch:

  * `matmul`: projections and the LM head, one fixed-shape dot per tile;
  * `rms_norm`, `log_softmax`: row reductions over the minor axis, per tile;
  * `attention`: an online softmax (Milakov & Gimelshein 2018) over key blocks of KEY_BLOCK
    positions aligned at position 0, per tile of queries, each query reading its own
    keys by position. The trainer's full-sequence pass (`self_attention`) and the engine's
    prefill, extend and decode (`paged_attention`) run this same reduction; a block with no
    visible key leaves the running max, normaliser and output unchanged exactly (its
    rescale factor is exp(0) = 1 and it adds zeros), so reading more blocks than a query
    needs changes nothing.

Elementwise operations (RoPE, SiLU, residual adds) and gathers are row-invariant as they are.
Cost: a loop step per tile and per key block instead of one large call, and a copy of each
query's keys per block; see docs/batch-invariance.md for the measured throughput.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

TILE_ROWS = 16  # rows per compiled tile (every call pads its rows to a multiple)
KEY_BLOCK = 16  # key positions per block of the online softmax, aligned at position 0
NEG_INF = -1e30


def map_rows(fn: Callable, *xs: jax.Array):
    """`fn` applied to the rows of `xs` (each N×…, the same N) TILE_ROWS rows at a time.

    The rows are padded with zeros to a multiple of TILE_ROWS and `lax.map` runs `fn` on one
    R×… tile of each array per step, so `fn` is compiled for one shape whatever N is. `fn`
    must treat rows independently. Returns `fn`'s outputs (a pytree of R×… arrays) with
    their rows put back: N×…."""
    n = xs[0].shape[0]
    # at least two steps: XLA removes a loop of one, and its body then fuses with what
    # surrounds it (XLA:CPU's YNNPACK fusions take a dot and the reductions after it into
    # one kernel: measured, a one-tile head + log-softmax rounds differently from the loop)
    tiles = max(-(-n // TILE_ROWS), 2)

    def split(x):
        x = jnp.pad(x, [(0, tiles * TILE_ROWS - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(tiles, TILE_ROWS, *x.shape[1:])

    out = bits_map(lambda tile: fn(*tile), tuple(split(x) for x in xs))
    return jax.tree.map(lambda y: y.reshape(tiles * TILE_ROWS, *y.shape[2:])[:n], out)


def _bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its uint16 bits (other arrays as they are)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def bits_map(fn: Callable, xs):
    """`jax.lax.map(fn, xs)` with 16-bit float inputs and outputs carried through the loop as
    their uint16 bits, bit for bit the same result. XLA:CPU computes a bfloat16
    dynamic-update-slice (a step writing its tile of the output) in float32, converting the
    whole output buffer there and back at every step: a cost quadratic in the tile count
    (measured: the quick start's old_log_prob pass over 32 × 64 tokens at 0.22× the default
    path's tokens/s in bfloat16, against 0.58× in float32)."""
    dtypes = jax.tree.map(lambda x: x.dtype, xs)
    slices = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    out_dtypes = jax.tree.map(lambda y: y.dtype, jax.eval_shape(fn, slices))
    back = lambda x, dtype: jax.lax.bitcast_convert_type(x, dtype)  # noqa: E731
    body = lambda t: jax.tree.map(_bits, fn(jax.tree.map(back, t, dtypes)))  # noqa: E731
    return jax.tree.map(back, jax.lax.map(body, jax.tree.map(_bits, xs)), out_dtypes)


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x (…×K) contracted with w's first axis (K×…), as `jnp.tensordot(x, w, 1)`, each row
    by the same R×K × K×M dot (M = w's trailing size). `out_dtype`: the dot's
    `preferred_element_type` (None: x's dtype). Returns …×(w's trailing dims)."""
    lead, k = x.shape[:-1], x.shape[-1]
    w_KxM = w.reshape(k, -1)
    dot = lambda t: jnp.dot(t, w_KxM, preferred_element_type=out_dtype)  # noqa: E731
    out = map_rows(dot, x.reshape(-1, k))
    return out.reshape(*lead, *w.shape[1:])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`decoder.RMSNorm`'s x / sqrt(mean(x²) + eps) · weight (statistics in float32, result
    in x's dtype), per tile of rows over the last axis."""

    def norm(t):
        t32 = t.astype(jnp.float32)
        t32 = t32 * jax.lax.rsqrt(jnp.mean(t32 * t32, axis=-1, keepdims=True) + eps)
        return weight.astype(t.dtype) * t32.astype(t.dtype)

    return map_rows(norm, x.reshape(-1, x.shape[-1])).reshape(x.shape)


def log_softmax(logits: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax` over the last axis, per tile of rows (any leading shape)."""
    rows = logits.reshape(-1, logits.shape[-1])
    return map_rows(lambda t: jax.nn.log_softmax(t, axis=-1), rows).reshape(logits.shape)


# A key-block reader: (block j, the tile's index) -> (keys R×S×K×D, values R×S×K×D, key
# positions R×S int32, key valid R×S bool), R = TILE_ROWS, S = KEY_BLOCK: each query of the
# tile its own copy of its keys, so that every caller runs the same R·K small products.
BlockReader = Callable[[jax.Array, jax.Array], tuple[jax.Array, ...]]


def attention(
    q_NxRxHxD: jax.Array,
    positions_NxR: jax.Array,
    read_block: BlockReader,
    num_blocks: int | jax.Array,
    kv_heads: int,
    sliding_window: int | None = None,
) -> jax.Array:
    """Softmax(q·kᵀ/√D)·v of N tiles of R = TILE_ROWS queries over the keys `read_block` gives
    each tile, key block by key block (blocks 0 .. num_blocks−1, KEY_BLOCK positions each),
    H query heads sharing K = H/G key/value heads. A key is seen when valid, at a position
    ≤ the query's, and (with a window) less than `sliding_window` positions back.

    Per query and block (float32): s = Σ_d q·k / √D, m' = max(m, max s),
    p = exp(s − m'), l' = e^{m−m'}·l + Σ p, o' = e^{m−m'}·o + Σ_s p·v; out = o / l (0 for a
    query that sees no key). The tiles run one per loop step, so a query's result depends
    only on its own keys, never on the other queries of the call.

    `num_blocks` may be traced (a bound that covers every query's position); extra blocks
    are no-ops, and a tile stops at the block of its last query. `kv_heads`: K, the third
    axis of what `read_block` returns. Returns N×R×H×D in q's dtype.
    """
    _, r, h, d = q_NxRxHxD.shape
    g = h // kv_heads

    def tile(q_RxHxD, pos_R, index):
        q_RxKxGxD = q_RxHxD.astype(jnp.float32).reshape(r, kv_heads, g, d)

        def block(j, carry):
            m_RxKxG, l_RxKxG, o_RxKxGxD = carry
            k_RxSxKxD, v_RxSxKxD, k_pos_RxS, k_valid_RxS = read_block(j, index)
            k = k_RxSxKxD.astype(jnp.float32)
            s = jnp.einsum("rkgd,rskd->rkgs", q_RxKxGxD, k) * d**-0.5
            mask = k_valid_RxS & (k_pos_RxS <= pos_R[:, None])
            if sliding_window is not None:
                mask &= pos_R[:, None] - k_pos_RxS < sliding_window
            mask = mask[:, None, None, :]
            m_new = jnp.maximum(m_RxKxG, jnp.max(jnp.where(mask, s, NEG_INF), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # R×K×G×S
            alpha = jnp.exp(m_RxKxG - m_new)
            pv = jnp.einsum("rkgs,rskd->rkgd", p, v_RxSxKxD.astype(jnp.float32))
            return m_new, alpha * l_RxKxG + jnp.sum(p, axis=-1), alpha[..., None] * o_RxKxGxD + pv

        stats = jnp.full((r, kv_heads, g), NEG_INF, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((r, kv_heads, g, d), jnp.float32))
        # blocks past the tile's last query are no-ops: skipped (causal), by a `cond` in a
        # loop of static length where `num_blocks` is static (the trainer's, differentiable)
        stop = jnp.max(pos_R) // KEY_BLOCK + 1
        step = lambda j, c: jax.lax.cond(j < stop, block, lambda _, c: c, j, c)  # noqa: E731
        _, l_RxKxG, o_RxKxGxD = jax.lax.fori_loop(0, num_blocks, step, init)
        seen = l_RxKxG > 0
        out = jnp.where(seen[..., None], o_RxKxGxD / jnp.where(seen, l_RxKxG, 1.0)[..., None], 0.0)
        return out.reshape(r, h, d).astype(q_RxHxD.dtype)

    n = q_NxRxHxD.shape[0]
    steps = max(n, 2)  # a loop of at least two steps (see `map_rows`)
    pad = lambda x: jnp.pad(x, [(0, steps - n)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    index = jnp.arange(steps, dtype=jnp.int32)
    out = bits_map(lambda xs: tile(*xs), (pad(q_NxRxHxD), pad(positions_NxR), index))
    return out[:n]


def _tiles(x_BxTx: jax.Array) -> jax.Array:
    """B×T×… → (B·T′/R)×R×… with T padded to T′, a multiple of R = TILE_ROWS: each tile
    holds consecutive tokens of one row."""
    b, t = x_BxTx.shape[:2]
    pad = -t % TILE_ROWS
    x = jnp.pad(x_BxTx, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxTx.ndim - 2))
    return x.reshape(b * (t + pad) // TILE_ROWS, TILE_ROWS, *x.shape[2:])


def self_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    positions_BxT: jax.Array,
    valid_BxT: jax.Array,
    sliding_window: int | None = None,
) -> jax.Array:
    """`attention` of T tokens over themselves (a padded batch, causal by position): the
    keys are placed by position (positions of valid tokens distinct within a row, as
    `decoder.default_positions` gives), so block j holds positions [j·S, (j+1)·S) as in the
    engine's pages; each tile holds R consecutive queries of one row.
    Returns B×T×H×D in q's dtype; outputs at invalid queries are garbage."""
    b, t = positions_BxT.shape
    blocks = max(-(-t // KEY_BLOCK), 2)  # a loop of at least two steps, as in `map_rows`
    width = blocks * KEY_BLOCK
    rows = jnp.arange(b)[:, None]
    at = jnp.where(valid_BxT, positions_BxT, width)  # invalid tokens: dropped

    def place(x, fill):
        base = jnp.full((b, width, *x.shape[2:]), fill, x.dtype)
        return base.at[rows, at].set(x, mode="drop")

    k_by_pos, v_by_pos = place(k_BxTxKxD, 0), place(v_BxTxKxD, 0)
    valid_by_pos = place(valid_BxT, False)
    per_row = -(-t // TILE_ROWS)

    def read_block(j, index):
        row, start = index // per_row, j * KEY_BLOCK
        # each query its own copy of its row's keys, as the engine reads its pages: with keys
        # broadcast over the tile XLA rewrites the products into another contraction
        # (measured: other bits at one kv head per query head, D = 64). Adding a traced zero
        # keeps the copies apart (XLA does not fold x · 0.0 for floats), cheaper than a gather.
        zero = index.astype(jnp.float32) * 0.0

        def take(x):
            block = jax.lax.dynamic_slice_in_dim(x[row], start, KEY_BLOCK)
            copies = jnp.broadcast_to(block, (TILE_ROWS, *block.shape))
            return copies if x.dtype == jnp.bool_ else copies + zero.astype(x.dtype)

        pos_RxS = jnp.broadcast_to(start + jnp.arange(KEY_BLOCK), (TILE_ROWS, KEY_BLOCK))
        return take(k_by_pos), take(v_by_pos), pos_RxS, take(valid_by_pos)

    kv = k_BxTxKxD.shape[2]
    out = attention(_tiles(q_BxTxHxD), _tiles(positions_BxT), read_block, blocks, kv,
                    sliding_window)  # fmt: skip
    return out.reshape(b, -1, *out.shape[2:])[:, :t]


def paged_attention(
    q_BxTxHxD: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """`attention` of each query to its sequence's pages (the engine's prefill, extend and
    decode in parity mode): key position p of row b is page `page_table[b, p // page_size]`
    at offset p % page_size of the K×N×S×D pool (or, with `layer`, of layer `layer` of a
    stacked L×K×N×S×D pool), read KEY_BLOCK positions at a time up to the call's last
    position. Every written position ≤ the query's is valid (the cache's rule). The queries
    are tiled R at a time across rows, each reading its own keys. Returns B×T×H×D in q's
    dtype."""
    b, t, h, d = q_BxTxHxD.shape
    page_size = k_pages.shape[-2]
    width = page_table_BxP.shape[1]
    k_pool = k_pages if layer is None else jax.lax.dynamic_index_in_dim(k_pages, layer, 0, False)
    v_pool = v_pages if layer is None else jax.lax.dynamic_index_in_dim(v_pages, layer, 0, False)
    n = -(-(b * t) // TILE_ROWS)
    rows_NxR = jnp.minimum(jnp.arange(n * TILE_ROWS) // t, b - 1).reshape(n, TILE_ROWS)

    def read_block(j, index):
        row_R = rows_NxR[jnp.minimum(index, n - 1)]
        pos_S = j * KEY_BLOCK + jnp.arange(KEY_BLOCK)
        slot_S = jnp.minimum(pos_S // page_size, width - 1)
        page_RxS = page_table_BxP[row_R[:, None], slot_S[None, :]]
        offset_S = pos_S % page_size
        read = lambda pool: jnp.moveaxis(pool[:, page_RxS, offset_S[None, :]], 0, 2)  # noqa: E731
        pos_RxS = jnp.broadcast_to(pos_S, (TILE_ROWS, KEY_BLOCK))
        return read(k_pool), read(v_pool), pos_RxS, pos_RxS < width * page_size

    flat = lambda x: jnp.pad(x.reshape(b * t, *x.shape[2:]),  # noqa: E731
                             [(0, n * TILE_ROWS - b * t)] + [(0, 0)] * (x.ndim - 2))  # fmt: skip
    q = flat(q_BxTxHxD).reshape(n, TILE_ROWS, h, d)
    pos = flat(positions_BxT).reshape(n, TILE_ROWS)
    blocks = jnp.max(positions_BxT) // KEY_BLOCK + 1
    kv = k_pages.shape[-4]
    out = attention(q, pos, read_block, blocks, kv, sliding_window)
    return out.reshape(n * TILE_ROWS, h, d)[: b * t].reshape(b, t, h, d)
