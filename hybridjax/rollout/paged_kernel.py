"""The GPU decode kernel: paged attention that reads the pages in place, in Pallas on Triton.

One program per (row, kv head) walks its row's page table a block of pages at a time, with an
online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
loop of FlashAttention, Dao et al. 2022): the page table and the layer index drive the loads,
which read K and V straight out of the stacked L×K×N×S×D pools (a `pallas_call` operand is a
pointer on Triton: nothing is sliced or copied first), and only the blocks up to the row's
position (from the window's first one with a sliding window) are read. Scratch: the output and
each program's registers, independent of the context length, the page count and the layers.

The query heads of one kv head (the GQA group, H / K of them) are one M×D tile of the kernel's
dots, padded to a power of two of at least 16 (Triton's `tl.dot` takes no smaller tile); a
block is `pages_per_block` pages of `page_size` keys (`kernel_blocks`). Triton compiles for
sm_80 (A100) and sm_90 (H100) alike: `compiler_params` names the Triton backend, which JAX
0.10 would otherwise replace with Mosaic GPU (Hopper only). On JAX 0.11+ the lowering reads
the target GPU from the mesh in context (`jax.set_mesh`) when the process's default backend is
not a GPU (a deviceless compile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybridjax.models.attention import NEG_INF

BLOCK_KEYS = 128  # keys per loop iteration (pages_per_block × page_size), where the table allows
BLOCK_BYTES = 32 << 10  # at most this much of K (and of V) per block: with Triton's 2 pipeline
# stages, 128 KB of shared memory (an A100 has 164 KB per SM; f32 blocks of 128 × 128 needed 264)
MIN_DOT = 16  # Triton's tl.dot: each dimension of a tile is at least 16


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def kernel_blocks(width: int, page_size: int, key_bytes: int = 256) -> tuple[int, int]:
    """(padded table width, pages per block) of the kernel for a table of `width` pages of
    `page_size` keys of `key_bytes` bytes (head dim × itemsize).

    A block is a power of two of pages, BLOCK_KEYS keys (fewer where one key is over
    BLOCK_BYTES / BLOCK_KEYS bytes) where the table is that wide, never fewer than MIN_DOT keys
    (a dot tile); the table is padded (with page 0, never attended: it lies past every
    position) to a whole number of blocks. Raises ValueError for a width or a page size
    below 1.
    """
    if width < 1 or page_size < 1:
        raise ValueError(f"page-table width and page_size must be >= 1, got {width}, {page_size}")
    keys = min(BLOCK_KEYS, _power_of_two_at_least(BLOCK_BYTES // key_bytes + 1) // 2)
    per_block = min(max(1, keys // page_size), _power_of_two_at_least(width))
    per_block = max(per_block, _power_of_two_at_least(-(-MIN_DOT // page_size)))
    return -(-width // per_block) * per_block, per_block


def _decode_kernel(
    layer_ref,  # (1,) int32: the layer of the stacked pools
    table_ref,  # (P,) int32: this row's pages
    position_ref,  # (1,) int32: this row's query position
    q_ref,  # (G, D): the query heads of this kv head (G padded)
    k_ref,  # (L, N, S, D): this kv head's pool, every layer and page (never loaded whole)
    v_ref,  # (L, N, S, D)
    o_ref,  # (G, D)
    *,
    pages_per_block: int,
    sliding_window: int | None,
):
    layer, position = layer_ref[0], position_ref[0]
    _, num_pages, page_size, d = k_ref.shape
    block_keys = pages_per_block * page_size
    q = q_ref[...]
    scale = d**-0.5

    def body(i, carry):
        o_GxD, m_G, l_G = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        pages = jnp.clip(pages, 0, num_pages - 1)  # unused entries may hold anything
        k = k_ref[layer, pages].reshape(block_keys, d)  # a gather of pages, in place
        v = v_ref[layer, pages].reshape(block_keys, d)
        dims = (((1,), (1,)), ((), ()))
        s_GxB = jax.lax.dot_general(q, k.astype(q.dtype), dims, preferred_element_type=jnp.float32)
        s_GxB = s_GxB * scale
        key = i * block_keys + jnp.arange(block_keys)
        keep = key <= position
        if sliding_window is not None:
            keep &= position - key < sliding_window
        s_GxB = jnp.where(keep[None, :], s_GxB, NEG_INF)
        m_new = jnp.maximum(m_G, s_GxB.max(axis=-1))
        alpha = jnp.exp(m_G - m_new)
        p_GxB = jnp.exp(s_GxB - m_new[:, None])
        l_G = alpha * l_G + p_GxB.sum(axis=-1)
        pv = jax.lax.dot_general(
            p_GxB.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return alpha[:, None] * o_GxD + pv, m_new, l_G

    g = q.shape[0]
    start: int | jax.Array = 0
    if sliding_window is not None:  # the block of the window's first key
        start = jnp.maximum(position - sliding_window + 1, 0) // block_keys
    stop = position // block_keys + 1  # every block visited holds an attended key
    init = (
        jnp.zeros((g, d), jnp.float32),
        jnp.full((g,), NEG_INF, jnp.float32),
        jnp.zeros((g,), jnp.float32),
    )
    o_GxD, _, l_G = jax.lax.fori_loop(start, stop, body, init)
    o_ref[...] = (o_GxD / l_G[:, None]).astype(o_ref.dtype)


def paged_attention_kernel(
    q_BxTxHxD: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    layer: int | jax.Array | None = None,
    sliding_window: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
) -> jax.Array:
    """Attention of each row's query to its pages, keys at positions <= the query's (inside the
    sliding window): B×1×H×D in q's dtype, as `decode_attention.paged_attention_jnp`.

    Args:
      q_BxTxHxD: the queries, T = 1 (a decode step).
      k_pages, v_pages: one layer's K×N×S×D pools, or with `layer` stacked L×K×N×S×D pools.
      page_table_BxP: int32 pages of each row; entries past a row's position are never
        attended (out-of-range ones are clamped, not read out of bounds).
      positions_BxT: int32 position of each query (its row's length - 1).
      layer: the layer of stacked pools (an int32 scalar, may be traced), read by the kernel.
      interpret: run in Pallas interpret mode (any backend; the tests' CPU path).
      num_warps: Triton warps per program.

    Costs: reads each row's K/V pages up to its position once per kv head; no pool is sliced
    or copied, no K/V gathered to memory. Raises ValueError for T != 1, H not a multiple of K,
    or a page size or head dim that is not a power of two (Triton tiles).
    """
    b, t, h, d = q_BxTxHxD.shape
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0  # a free reshape
    _, kv, num_pages, page_size, _ = k_pages.shape
    if t != 1:
        raise ValueError(f"the decode kernel takes one query per row, got {t}")
    if h % kv:
        raise ValueError(f"the decode kernel needs heads ({h}) a multiple of kv heads ({kv})")
    for name, n in (("page_size", page_size), ("head_dim", d)):
        if n & (n - 1):
            raise ValueError(f"the decode kernel needs a power-of-two {name}, got {n}")
    width = page_table_BxP.shape[1]
    padded, per_block = kernel_blocks(width, page_size, d * jnp.dtype(k_pages.dtype).itemsize)
    table = jnp.pad(page_table_BxP.astype(jnp.int32), ((0, 0), (0, padded - width)))
    group = h // kv
    tile = max(MIN_DOT, _power_of_two_at_least(group))
    q = q_BxTxHxD.reshape(b, kv, group, d)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, tile - group), (0, 0)))
    layers = k_pages.shape[0]
    pool = pl.BlockSpec((layers, None, num_pages, page_size, d), lambda i, j: (0, j, 0, 0, 0))
    heads = pl.BlockSpec((None, None, tile, d), lambda i, j: (i, j, 0, 0))
    kernel = functools.partial(
        _decode_kernel, pages_per_block=per_block, sliding_window=sliding_window
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, kv),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),  # layer
            pl.BlockSpec((None, padded), lambda i, j: (i, 0)),  # page table row
            pl.BlockSpec((1,), lambda i, j: (i,)),  # position
            heads,
            pool,
            pool,
        ],
        out_specs=heads,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name=f"paged_decode_{tile}x{per_block}x{page_size}",
    )(
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        table,
        positions_BxT[:, 0].astype(jnp.int32),
        q,
        k_pages,
        v_pages,
    )
    return out[:, :, :group].reshape(b, 1, h, d)
