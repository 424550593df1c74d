"""Decode attention over the paged KV pool: the kernel choice behind one function.

`decode_attention` runs each sequence's queries against its pages with the kernel
`select_decode_kernel` picked for the devices it runs on:
  * "pallas" (the GPU default): our Pallas Triton kernel (`paged_kernel.paged_attention_kernel`),
    which reads the pages of the stacked pools in place, driven by the layer and the page
    table, with an online softmax over blocks of pages;
  * "jnp" (CPU and TPU): `paged_attention_blocked`, the same online softmax over blocks of
    pages in jnp: each block's pages are gathered (B×block keys), never a row's whole context.
Both keep their scratch independent of the context length. `paged_attention_jnp`, one gather of
every page of every row then a plain softmax, is the reference both are tested against.

On a generation mesh the kernel runs inside `jax.shard_map`: a `pallas_call` is opaque to the
SPMD partitioner, which would otherwise all-gather q and the whole pool over `tensor` and run
every row on every device. Inside, each device sees its rows (split over `data`), its query
heads and its kv heads (split over `tensor`) and every page of the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hybridjax.models.attention import NEG_INF, attention_mask
from hybridjax.rollout.paged_kernel import paged_attention_kernel

DECODE_KERNELS = ("jnp", "pallas")
JNP_BLOCK_KEYS = 256  # keys per block of `paged_attention_blocked` (whole pages, at least one)


def select_decode_kernel(
    impl: str,
    sliding_window: int | None,
    backend: str,
    head_dim: int = 128,
    page_size: int = 16,
) -> str:
    """The decode kernel for `rollout.attention_impl` = `impl` on `backend` ("cpu", "gpu",
    "tpu": the platform of the generation mesh's devices, `hybridjax.platforms.platform_of`), for a
    model of `head_dim` and pages of `page_size` tokens.

    "auto" → "pallas" on a GPU where the kernel takes the shapes (power-of-two head dim and
    page size: Triton tiles), "jnp" elsewhere. "pallas" (the Pallas Triton kernel) needs a GPU
    and those shapes; `sliding_window` is accepted by both kernels (kept for the planner's
    callers). Raises ValueError for "pallas" off a GPU or at other shapes, or an unknown
    `impl`.
    """
    del sliding_window  # both kernels take it
    tiles = all(n > 0 and n & (n - 1) == 0 for n in (head_dim, page_size))
    if impl == "auto":
        return "pallas" if backend == "gpu" and tiles else "jnp"
    if impl not in DECODE_KERNELS:
        raise ValueError(
            f"unknown decode kernel {impl!r}; expected 'auto' or one of {DECODE_KERNELS}"
        )
    if impl == "pallas" and backend != "gpu":
        raise ValueError(f"rollout.attention_impl 'pallas' needs a GPU, the backend is {backend!r}")
    if impl == "pallas" and not tiles:
        raise ValueError(
            f"rollout.attention_impl 'pallas' needs a power-of-two head_dim and page_size, got "
            f"{head_dim} and {page_size}; use 'jnp'"
        )
    return impl


def read_layer(array: jax.Array, layer: int | jax.Array | None = None) -> jax.Array:
    """Layer `layer` of a stacked array (L×…), or `array` itself for layer None (one layer's
    array already). Cost: a dynamic slice, which XLA materialises unless it fuses it into
    the consumer: one layer's array copied per call."""
    if layer is None:
        return array
    return jax.lax.dynamic_index_in_dim(array, layer, axis=0, keepdims=False)


def gather_pages(
    pages_KxNxSxD: jax.Array, page_table_BxP: jax.Array, layer: int | jax.Array | None = None
) -> jax.Array:
    """Each sequence's pages laid end to end: K×B×(P·S)×D (key j of row b at index j).

    `pages_KxNxSxD` is one layer's K×N×S×D pool, or a stacked L×K×N×S×D pool: with `layer`
    (an int32 scalar, may be traced) one gather at (layer, page) reads that layer's pages
    only, no copy of its pool first; without, every layer's: L×K×B×(P·S)×D.
    """
    kv, _, page_size, d = pages_KxNxSxD.shape[-4:]
    b, p = page_table_BxP.shape
    if layer is None:
        lead = pages_KxNxSxD.shape[:-4]
        return pages_KxNxSxD[..., page_table_BxP, :, :].reshape(*lead, kv, b, p * page_size, d)
    layer_BxP = jnp.broadcast_to(jnp.asarray(layer, page_table_BxP.dtype), (b, p))
    index_BxPx2 = jnp.stack([layer_BxP, page_table_BxP], axis=-1)
    numbers = jax.lax.GatherDimensionNumbers(
        offset_dims=(0, 3, 4),  # K, S, D around the indices' B×P: K×B×P×S×D, no transpose
        collapsed_slice_dims=(0, 2),
        start_index_map=(0, 2),
    )
    out = jax.lax.gather(
        pages_KxNxSxD,
        index_BxPx2,
        numbers,
        slice_sizes=(1, kv, 1, page_size, d),
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    return out.reshape(kv, b, p * page_size, d)


def sequence_attention(
    q_BxTxHxD: jax.Array,
    k_KxBxLxD: jax.Array,
    v_KxBxLxD: jax.Array,
    positions_BxT: jax.Array,
    sliding_window: int | None = None,
) -> jax.Array:
    """Attention of each query to keys 0 .. L-1 of its own row of a K×B×L×D copy, causally by
    position (key j is attended when j <= the query's position, and inside the sliding window):
    keys past a sequence's length are masked by that rule. Softmax in float32; output B×T×H×D
    in q's dtype."""
    b, t, h, d = q_BxTxHxD.shape
    kv, _, length, _ = k_KxBxLxD.shape
    # Batch dimensions (k, b) in the copies' order, keys as the left operand (contracting their
    # last dimension): only q, the logits and the output (small) are transposed, never the
    # keys/values (XLA's CPU dot would copy a transposed K×B×D×L key array at every step).
    q_KxBxDxGT = q_BxTxHxD.reshape(b, t, kv, h // kv, d).transpose(2, 0, 4, 3, 1)
    q_KxBxDxGT = q_KxBxDxGT.reshape(kv, b, d, -1)
    logits_KxBxLxGT = jnp.einsum(
        "kbld,kbdx->kblx",
        k_KxBxLxD.astype(q_BxTxHxD.dtype),
        q_KxBxDxGT,
        preferred_element_type=jnp.float32,
    )
    logits = logits_KxBxLxGT.reshape(kv, b, length, h // kv, t).transpose(0, 1, 3, 4, 2)
    logits = logits * (d**-0.5)
    k_pos_BxL = jnp.broadcast_to(jnp.arange(length), (b, length))
    mask = attention_mask(positions_BxT, k_pos_BxL, jnp.ones_like(k_pos_BxL, bool), sliding_window)
    mask = mask[None, :, None]  # 1×B×1×T×L
    probs = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(q_BxTxHxD.dtype)
    out = jnp.einsum("kbgtl,kbld->kbgtd", probs, v_KxBxLxD.astype(q_BxTxHxD.dtype))
    return out.transpose(1, 3, 0, 2, 4).reshape(b, t, h, d)


def paged_attention_jnp(
    q_BxTxHxD: jax.Array,
    k_pages_KxNxSxD: jax.Array,
    v_pages_KxNxSxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Attention of each query to its sequence's pages: a gather of P pages per sequence, then
    `sequence_attention`. Unused page-table entries may point anywhere (masked by position).
    With `layer`, the pools are stacked L×K×N×S×D and layer `layer` is read (`gather_pages`).
    Cost: gathers B×P×S×K×D per layer (the test oracle; the decode loop gathers once per call,
    see `PagedKVCache.gathered`)."""
    k_seq = gather_pages(k_pages_KxNxSxD, page_table_BxP, layer)
    v_seq = gather_pages(v_pages_KxNxSxD, page_table_BxP, layer)
    return sequence_attention(q_BxTxHxD, k_seq, v_seq, positions_BxT, sliding_window)


def paged_attention_blocked(
    q_BxTxHxD: jax.Array,
    k_pages_KxNxSxD: jax.Array,
    v_pages_KxNxSxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    sliding_window: int | None = None,
    layer: int | jax.Array | None = None,
    block_keys: int = JNP_BLOCK_KEYS,
) -> jax.Array:
    """`paged_attention_jnp`'s result (B×T×H×D in q's dtype) by an online softmax over blocks of
    pages (Milakov & Gimelshein 2018): a loop gathers one block of `block_keys // S` pages of
    every row at a time (`gather_pages`, at `layer` of stacked pools) and folds it into a
    running max, normaliser and output. Only the blocks up to the batch's last position (from
    its first window start) are read.

    Scratch: one block's K/V, B×K×block_keys×D each, and the f32 output, never a row's whole
    context: independent of the table width. Unused page-table entries may point anywhere
    (masked by position; gathered with clipping).
    """
    b, t, h, d = q_BxTxHxD.shape
    kv, _, page_size, _ = k_pages_KxNxSxD.shape[-4:]
    width = page_table_BxP.shape[1]
    per_block = max(1, min(block_keys // page_size, width))
    blocks = -(-width // per_block)
    table = jnp.pad(page_table_BxP, ((0, 0), (0, blocks * per_block - width)))
    keys, g = per_block * page_size, h // kv
    # the G·T queries of each kv head as the right operand (see `sequence_attention`)
    q_KxBxDxX = q_BxTxHxD.reshape(b, t, kv, g, d).transpose(2, 0, 4, 3, 1).reshape(kv, b, d, -1)
    q_KxBxDxX = q_KxBxDxX.astype(jnp.float32)

    def body(i, carry):
        o_KxBxXxD, m_KxBxX, l_KxBxX = carry
        pages_BxC = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        k_KxBxLxD = gather_pages(k_pages_KxNxSxD, pages_BxC, layer)
        v_KxBxLxD = gather_pages(v_pages_KxNxSxD, pages_BxC, layer)
        # float32 products (exact for bf16 inputs) and sums: XLA:CPU has no bf16 × bf16 → f32
        # dot in these forms
        s_KxBxLxX = jnp.einsum("kbld,kbdx->kblx", k_KxBxLxD.astype(jnp.float32), q_KxBxDxX)
        s_KxBxXxL = jnp.swapaxes(s_KxBxLxX, 2, 3) * (d**-0.5)
        k_pos_BxL = jnp.broadcast_to(i * keys + jnp.arange(keys), (b, keys))
        valid_BxL = jnp.ones_like(k_pos_BxL, bool)
        mask_BxTxL = attention_mask(positions_BxT, k_pos_BxL, valid_BxL, sliding_window)
        mask = jnp.broadcast_to(mask_BxTxL[:, None], (b, g, t, keys)).reshape(1, b, g * t, keys)
        s_KxBxXxL = jnp.where(mask, s_KxBxXxL, NEG_INF)
        m_new = jnp.maximum(m_KxBxX, s_KxBxXxL.max(axis=-1))
        p_KxBxXxL = jnp.where(mask, jnp.exp(s_KxBxXxL - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_KxBxX - m_new)
        p_cast = p_KxBxXxL.astype(q_BxTxHxD.dtype).astype(jnp.float32)  # as the reference's
        pv_KxBxXxD = jnp.einsum("kbxl,kbld->kbxd", p_cast, v_KxBxLxD.astype(jnp.float32))
        o_KxBxXxD = alpha[..., None] * o_KxBxXxD + pv_KxBxXxD
        return o_KxBxXxD, m_new, alpha * l_KxBxX + p_KxBxXxL.sum(axis=-1)

    start: int | jax.Array = 0
    if sliding_window is not None:  # the block of the earliest window start
        start = jnp.maximum(jnp.min(positions_BxT) - sliding_window + 1, 0) // keys
    stop = jnp.minimum(jnp.max(positions_BxT) // keys + 1, blocks)
    init = (
        jnp.zeros((kv, b, g * t, d), jnp.float32),
        jnp.full((kv, b, g * t), NEG_INF, jnp.float32),
        jnp.zeros((kv, b, g * t), jnp.float32),
    )
    o_KxBxXxD, _, l_KxBxX = jax.lax.fori_loop(start, stop, body, init)
    out = (o_KxBxXxD / l_KxBxX[..., None]).astype(q_BxTxHxD.dtype)
    return out.reshape(kv, b, g, t, d).transpose(1, 3, 0, 2, 4).reshape(b, t, h, d)


def _mesh_axis(mesh, name: str, size: int, manual: frozenset[str]) -> str | None:
    """`name` when that mesh axis exists, is not already manual (inside an enclosing
    `shard_map`) and splits a dimension of `size` evenly, else None."""
    n = dict(mesh.shape).get(name, 1)
    return name if n > 1 and size % n == 0 and name not in manual else None


def decode_specs(
    mesh, rows: int, heads: int, kv_heads: int, manual=frozenset(), stacked: bool = False
):
    """(q, pool, table/positions) PartitionSpecs of decode attention on `mesh`: rows by
    `data`, query and kv heads by `tensor` (both, or neither: a device's query heads must
    attend to its own kv heads), the pool's pages whole (and a stacked pool's layers).
    Axes in `manual` (already split by an enclosing `shard_map`, e.g. the engine's
    per-replica region over `data`) are left out."""
    data = _mesh_axis(mesh, "data", rows, manual)
    tensor = _mesh_axis(mesh, "tensor", kv_heads, manual)
    tensor = tensor if tensor and heads % mesh.shape["tensor"] == 0 else None
    pool = PartitionSpec(*((None,) if stacked else ()), tensor)
    return PartitionSpec(data, None, tensor), pool, PartitionSpec(data)


def _kernel(kernel: str, *, sliding_window: int | None, interpret: bool):
    """The kernel `kernel` as fn(q, k, v, table, positions, layer=None)."""
    if kernel == "jnp":
        return lambda q, k, v, table, positions, layer=None: paged_attention_blocked(
            q, k, v, table, positions, sliding_window, layer
        )
    if kernel == "pallas":
        return lambda q, k, v, table, positions, layer=None: paged_attention_kernel(
            q, k, v, table, positions, layer, sliding_window, interpret
        )
    raise ValueError(f"unknown decode kernel {kernel!r}; expected one of {DECODE_KERNELS}")


def decode_attention(
    q_BxTxHxD: jax.Array,
    k_pages_KxNxSxD: jax.Array,
    v_pages_KxNxSxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    *,
    kernel: str,
    mesh: Mesh | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    layer: int | jax.Array | None = None,
) -> jax.Array:
    """Attention of each sequence's queries to its pages (positions <= the query's, inside the
    sliding window): B×T×H×D in q's dtype, by `kernel` ("jnp" or "pallas", see
    `select_decode_kernel`; `interpret` runs Pallas in interpret mode, for tests).

    The pools are one layer's K×N×S×D, or with `layer` (an int32 scalar, may be traced: a
    scan over layers) stacked L×K×N×S×D pools read at that layer. Neither kernel copies a
    layer's pool: the jnp kernel gathers one block of pages at a time at (layer, page), the
    Pallas kernel loads them in place.

    With `mesh` (axes "data", "tensor"), the kernel runs per device inside `jax.shard_map`
    (`decode_specs`): no collective at all, each device attends its rows with its heads.
    Inside an enclosing `shard_map` (the engine's per-replica region, manual over `data`) only
    the axes not yet manual are split.
    Raises ValueError for an unknown kernel (and see `paged_kernel.paged_attention_kernel`).
    """
    fn = _kernel(kernel, sliding_window=sliding_window, interpret=interpret)
    # both kernels take the layer (of stacked pools) as their sixth argument
    layers = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    args = (q_BxTxHxD, k_pages_KxNxSxD, v_pages_KxNxSxD, page_table_BxP, positions_BxT, *layers)
    if mesh is None:
        return fn(*args)
    rows, _, heads, _ = q_BxTxHxD.shape
    context = jax.sharding.get_abstract_mesh()
    manual = frozenset(() if context.empty else context.manual_axes)
    kv_heads = k_pages_KxNxSxD.shape[-4]
    specs = decode_specs(mesh, rows, heads, kv_heads, manual, stacked=layer is not None)
    q_spec, pool_spec, row_spec = specs
    layer_spec = () if layer is None else (PartitionSpec(),)  # every device reads it whole
    sharded = jax.shard_map(
        fn,
        mesh=context if manual else mesh,
        axis_names=frozenset(mesh.axis_names) - manual,
        in_specs=(q_spec, pool_spec, pool_spec, row_spec, row_spec, *layer_spec),
        out_specs=q_spec,
        check_vma=False,  # pallas_call has no varying-manual-axes rule
    )
    return sharded(*args)
