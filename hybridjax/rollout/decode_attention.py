"""Decode attention over the paged KV pool: the kernel choice behind one function.

`decode_attention` runs one query per sequence against its pages with the kernel
`select_decode_kernel` picked: the jnp gather (`paged_attention_jnp`, the reference
every kernel is tested against) or the Pallas Triton GPU kernel
(`jax.experimental.pallas.ops.gpu.paged_attention`). On a generation mesh the kernel runs inside
`jax.shard_map`: a `pallas_call` is opaque to the SPMD partitioner, which would otherwise
all-gather q and the whole pool over `tensor` and run every row on every device. Inside, each
device sees its rows (split over `data`), its query heads and its kv heads (split over
`tensor`) and every page of the pool (the pool's page dimension is replicated over `data`).

Pallas Triton accepts only power-of-two blocks: `pallas_blocks` pads the page table to a whole
number of power-of-two partitions, so the kernel lowers at every width the engine compiles
(checked on CPU with `jax.export(..., platforms=("cuda",))`, tests/rollout/
test_decode_attention.py). Upstream deprecated the Pallas Triton GPU kernels (JAX 0.11), and no
GPU measurement shows it faster than the partitioned jnp path yet: "auto" picks "jnp" on every
backend, "pallas" must be asked for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hybridjax.models.attention import NEG_INF, attention_mask

DECODE_KERNELS = ("jnp", "pallas")
MAX_K_SPLITS = 16  # upstream's default number of sequence partitions
MAX_PAGES_PER_BLOCK = 8  # upstream's default pages per compute block


def select_decode_kernel(impl: str, sliding_window: int | None, backend: str) -> str:
    """The decode kernel for `rollout.attention_impl` = `impl` on `backend` ("cpu", "gpu",
    "tpu").

    "auto" → "jnp" everywhere: the partitioned jnp path stays the GPU default until a kernel is
    measured faster on a GPU. "pallas" is the Pallas Triton kernel: GPU only, no sliding window.
    Raises ValueError for "pallas" with a sliding window or off a GPU, or an unknown `impl`.
    """
    if impl == "auto":
        return "jnp"
    if impl not in DECODE_KERNELS:
        raise ValueError(
            f"unknown decode kernel {impl!r}; expected 'auto' or one of {DECODE_KERNELS}"
        )
    if impl == "pallas" and sliding_window is not None:
        raise ValueError(
            "rollout.attention_impl 'pallas': the kernel has no sliding window; use 'jnp'"
        )
    if impl == "pallas" and backend != "gpu":
        raise ValueError(f"rollout.attention_impl 'pallas' needs a GPU, the backend is {backend!r}")
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


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pallas_blocks(width: int) -> tuple[int, int, int]:
    """(padded table width, k_splits, pages_per_compute_block) of the Pallas kernel for a page
    table of `width` pages.

    The kernel splits the table into `k_splits` partitions of `padded / k_splits` pages and
    loads `pages_per_compute_block` pages at a time; Triton needs both counts to be powers of
    two (the block-table block and the key block; with a power-of-two page size). Partitions
    are the smallest power of two (at least a compute block) that keeps `k_splits` <=
    MAX_K_SPLITS; the table is padded by fewer pages than one partition (widths 24, 48, 72, 96
    need none: 3, 6, 9, 12 partitions of 8).
    """
    if width < 1:
        raise ValueError(f"page-table width must be >= 1, got {width}")
    per_block = min(MAX_PAGES_PER_BLOCK, _power_of_two_at_least(width))
    per_split = max(per_block, _power_of_two_at_least(-(-width // MAX_K_SPLITS)))
    k_splits = -(-width // per_split)
    return k_splits * per_split, k_splits, per_block


def paged_attention_pallas(
    q_BxTxHxD: jax.Array,
    k_pages_KxNxSxD: jax.Array,
    v_pages_KxNxSxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas GPU kernel, one query per sequence (T = 1): the output B×1×H×D of
    `paged_attention_jnp` (keys at positions <= the query's), in q's dtype.

    The page table is padded with page 0 to `pallas_blocks` (padding lies past every length,
    so it is never attended). The kernel does not scale q itself: q·D^-½ is passed in the
    pool's dtype. Raises ValueError for T != 1 or a page size that is not a power of two, and
    ImportError where the kernel module does not exist (the import is deferred, so CPU installs
    of any JAX version never touch it).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged  # noqa: PLC0415

    b, t, h, d = q_BxTxHxD.shape
    if t != 1:
        raise ValueError(f"the Pallas paged-attention kernel takes one query per sequence, got {t}")
    page_size = k_pages_KxNxSxD.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(
            f"the Pallas paged-attention kernel needs a power-of-two page_size, got {page_size}"
        )
    width = page_table_BxP.shape[1]
    padded, k_splits, per_block = pallas_blocks(width)
    table = jnp.pad(page_table_BxP.astype(jnp.int32), ((0, 0), (0, padded - width)))
    q = (q_BxTxHxD[:, 0] * (d**-0.5)).astype(k_pages_KxNxSxD.dtype)
    lengths = (positions_BxT[:, 0] + 1).astype(jnp.int32)
    out = pallas_paged.paged_attention(
        q,
        k_pages_KxNxSxD,
        v_pages_KxNxSxD,
        table,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=per_block,
        interpret=interpret,
    )
    return out[:, None].astype(q_BxTxHxD.dtype)


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


def _jnp_layer(q, k, v, table, positions, layer=None, *, sliding_window: int | None):
    """`paged_attention_jnp`, the layer (None, or of stacked pools) as sixth argument."""
    return paged_attention_jnp(q, k, v, table, positions, sliding_window, layer)


def _pallas_layer(q, k, v, table, positions, layer=None, *, interpret: bool):
    """`paged_attention_pallas` on one layer: from stacked pools (`layer` given), a copy of
    that layer's pool (on a mesh, a device's kv heads, every page) made at every call."""
    k, v = read_layer(k, layer), read_layer(v, layer)
    return paged_attention_pallas(q, k, v, table, positions, interpret=interpret)


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
    scan over layers) stacked L×K×N×S×D pools read at that layer. The jnp kernel gathers the
    layer's pages directly; the Pallas kernel needs one layer's pool as an array, so it copies
    layer `layer` of the pool (on a mesh, each device its kv heads, all pages) at every call:
    one layer's pool per layer and decode step, the cost of a scanned model on that path.

    With `mesh` (axes "data", "tensor"), the kernel runs per device inside `jax.shard_map`
    (`decode_specs`): no collective at all, each device attends its rows with its heads.
    Inside an enclosing `shard_map` (the engine's per-replica region, manual over `data`) only
    the axes not yet manual are split.
    Raises ValueError for an unknown kernel (and see `paged_attention_pallas`).
    """
    if kernel == "jnp":
        fn = functools.partial(_jnp_layer, sliding_window=sliding_window)
    elif kernel == "pallas":
        if sliding_window is not None:
            raise ValueError("the Pallas paged-attention kernel has no sliding window")
        fn = functools.partial(_pallas_layer, interpret=interpret)
    else:
        raise ValueError(f"unknown decode kernel {kernel!r}; expected one of {DECODE_KERNELS}")
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
