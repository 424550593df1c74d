"""The paged KV cache: a pool of fixed-size pages per layer and a page table per sequence.

Pool layout per layer: k, v of shape K×N×S×D (kv_heads × num_pages × page_size × head_dim),
the layout of the Pallas GPU kernel, so the pool is never transposed; kv_heads is the dimension
sharded over the `tensor` mesh axis. Position p of sequence b lives in page
`page_table[b, p // S]` at offset `p % S`. Two layouts of the layers (`Pools`):
  * per layer: a tuple of L arrays K×N×S×D, indexed by a Python int layer (a decoder that
    loops over its layers);
  * stacked: one L×K×N×S×D array each for k and v (`stacked_layout`: a model with
    `scan_layers`), indexed by an int32 layer that may be traced (a `lax.scan` over the layers
    carrying the cache). Writes scatter into the stacked array at (layer, page, offset) and
    the reads gather at (layer, page) or (the Pallas kernel) load pages in place, so no step
    copies a layer's pool.
`layer_of`/`with_layer` address one layer in either layout.

`PagedKVCache` implements the cache protocol of `hybridjax.models.attention` (`attend`), so
`CausalLM.decode` runs on it unchanged. Two modes:
  * "prefill": queries attend to their own keys only (a prompt starts at position 0), and the
    keys/values are written to the pages;
  * "decode": the new keys/values are written first, then every query attends to its
    sequence's pages, causally by position: on the jnp path of the decode loop, while it is
    small, a K×B×L×D copy of the sequences' pages gathered once per jitted call
    (`PagedKVCache.gathered`) and kept up to date step by step; otherwise
    `decode_attention.decode_attention` with the cache's kernel (the Pallas kernel reading the
    pages in place, or the jnp online softmax over blocks of pages), inside `shard_map` on the
    cache's mesh.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hybridjax.models import invariant
from hybridjax.models.attention import attention_mask, dot_product_attention
from hybridjax.rollout.decode_attention import (
    decode_attention,
    gather_pages,
    read_layer,
    sequence_attention,
)

Pools = jax.Array | tuple[jax.Array, ...]  # one stacked L×… array, or one array per layer
Layer = int | jax.Array  # a layer index: a Python int, or an int32 scalar (traced in a scan)


def stacked_layout(config) -> bool:
    """Whether `config` (a ModelConfig) keeps its pools stacked, one L×K×N×S×D array each:
    models whose decoder layers run as one scan (`scan_layers`), which index the pools with
    a traced layer."""
    return bool(getattr(config, "scan_layers", False))


def pool_spec(stacked: bool, *axes: str | None) -> PartitionSpec:
    """The PartitionSpec of a pool given its (kv heads, pages, ...) mesh axes: a stacked
    pool's leading layer axis is never split (None)."""
    return PartitionSpec(*((None,) if stacked else ()), *axes)


def layer_of(pools: Pools, layer: Layer) -> tuple[jax.Array, Layer | None]:
    """(array, index) addressing layer `layer` of `pools` for the functions below, which take
    a per-layer array (index None) or a stacked array and the layer to read or write:
    a tuple gives (pools[layer], None), free; a stacked array gives (pools, layer), nothing
    copied. Raises TypeError for a tuple and a traced layer (per-layer pools are indexed by
    Python ints: pools for a scanned model are created stacked, `stacked_layout`)."""
    if not isinstance(pools, tuple):
        return pools, layer
    try:
        index = operator.index(layer)  # a traced layer has no concrete value
    except TypeError:
        raise TypeError(
            f"per-layer KV pools need a concrete int layer, got {type(layer).__name__}: a "
            "model that scans its layers needs stacked pools (PagedKVCache.create_pool with "
            "config.scan_layers)"
        ) from None
    return pools[index], None


def with_layer(pools: Pools, layer: Layer, array: jax.Array) -> Pools:
    """`pools` after an update of `layer_of(pools, layer)`'s array: a tuple with layer
    `layer` replaced, or the updated stacked array itself."""
    if not isinstance(pools, tuple):
        return array
    index = operator.index(layer)
    return pools[:index] + (array,) + pools[index + 1 :]


def write_pages(
    pages_KxNxSxD: jax.Array,
    new_BxTxKxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    token_mask_BxT: jax.Array,
    layer: Layer | None = None,
) -> jax.Array:
    """Stores each valid token's key (or value) at its position; masked tokens write nowhere.

    `pages_KxNxSxD` is one layer's pool, or with `layer` a stacked L×K×N×S×D pool written at
    that layer: one scatter into the stacked array (in place when it is donated or carried
    by a loop), never a copy of the layer's pool. new_BxTxKxD is cast to the pool's dtype.
    """
    _, num_pages, page_size, _ = pages_KxNxSxD.shape[-4:]
    page_BxT = jnp.take_along_axis(page_table_BxP, positions_BxT // page_size, axis=1)
    page_BxT = jnp.where(token_mask_BxT, page_BxT, num_pages)  # out of bounds: dropped
    offset_BxT = positions_BxT % page_size
    new = new_BxTxKxD.astype(pages_KxNxSxD.dtype)
    if layer is None:
        return pages_KxNxSxD.at[:, page_BxT, offset_BxT].set(jnp.moveaxis(new, 2, 0), mode="drop")
    # The layer and the page/offset indices are split by the kv-head slice, so NumPy's rule
    # puts their B×T first: the update is B×T×K×D, as given.
    return pages_KxNxSxD.at[layer, :, page_BxT, offset_BxT].set(new, mode="drop")


def write_sequences(
    seq_KxBxLxD: jax.Array,
    new_BxTxKxD: jax.Array,
    positions_BxT: jax.Array,
    token_mask_BxT: jax.Array,
    layer: Layer | None = None,
) -> jax.Array:
    """Stores each valid token's key (or value) at its position of a gathered K×B×L×D copy
    (or, with `layer`, of layer `layer` of a stacked copy: one scatter, in place as
    `write_pages`); masked tokens write nowhere."""
    b, _ = positions_BxT.shape
    index_BxT = jnp.where(token_mask_BxT, positions_BxT, seq_KxBxLxD.shape[-2])  # dropped
    new = new_BxTxKxD.astype(seq_KxBxLxD.dtype)
    rows_Bx1 = jnp.arange(b)[:, None]
    if layer is None:
        new_KxBxTxD = jnp.moveaxis(new, 2, 0)
        return seq_KxBxLxD.at[:, rows_Bx1, index_BxT].set(new_KxBxTxD, mode="drop")
    return seq_KxBxLxD.at[layer, :, rows_Bx1, index_BxT].set(new, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Page pools of every layer plus the page tables of the sequences in this call.

    k, v: a tuple of L per-layer K×N×S×D pools, or (a model that scans its layers,
      `stacked_layout`) one stacked L×K×N×S×D array each. page_table: B×P int32 (rows of the
      batch being run).
    k_seq, v_seq: optional K×B×(P·S)×D copies of the rows' pages per layer (a tuple, or one
      stacked L×K×B×(P·S)×D array with stacked pools; `gathered`); when present, decode steps
      attend to them (and keep them up to date) instead of gathering the pages again at every
      step.
    mode: "prefill" or "decode" (see the module docstring). impl: "jnp" or "pallas", the
      decode kernel (`decode_attention.select_decode_kernel`).
    mesh: the generation mesh the decode kernel runs on per device (`decode_attention`), or
      None (one device, or left to the SPMD partitioner).
    batch_invariant: parity mode (`ModelConfig.batch_invariant`): every mode writes the pages
      first, then attends to them with `invariant.paged_attention` (the trainer's reduction;
      no gathered copy, no kernel choice).
    """

    k: Pools
    v: Pools
    page_table: jax.Array
    mode: str = dataclasses.field(default="decode", metadata=dict(static=True))
    impl: str = dataclasses.field(default="jnp", metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    k_seq: Pools | None = None
    v_seq: Pools | None = None
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    batch_invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def create_pool(config, num_pages: int, page_size: int, dtype=jnp.float32):
        """Zeroed pools (k, v) for `config` (a ModelConfig): with `config.scan_layers`
        (`stacked_layout`) one L×K×N×S×D array each, else a tuple of L K×N×S×D arrays."""
        shape = (config.num_key_value_heads, num_pages, page_size, config.resolved_head_dim)
        layers = config.num_hidden_layers
        if stacked_layout(config):
            return jnp.zeros((layers, *shape), dtype), jnp.zeros((layers, *shape), dtype)
        return (
            tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        )

    @staticmethod
    def page_bytes(config, page_size: int, dtype=jnp.float32, tensor_parallel: int = 1) -> int:
        """Device bytes of one page across all layers, k and v (kv_heads split `tensor_parallel`
        ways)."""
        kv = math.ceil(config.num_key_value_heads / tensor_parallel)
        per_layer = kv * page_size * config.resolved_head_dim * jnp.dtype(dtype).itemsize
        return 2 * config.num_hidden_layers * per_layer

    @staticmethod
    def pages_from_memory(
        stats: Sequence[dict[str, int] | None], utilization: float, page_bytes: int
    ) -> int | None:
        """Pages a pool gets from the free memory of the devices it lives on, or None where a
        device reports no memory statistics (CPU).

        pages = floor(utilization × min_d(bytes_limit_d − bytes_in_use_d) / page_bytes), at
        least 1: a fraction of what is free on the tightest device once the weights are on it
        (verl's meaning of `gpu_memory_utilization` for vLLM 0.5–0.6; vLLM ≥ 0.7 takes the
        fraction of the whole device and subtracts weights and activations). Every replica's
        pool has the same pages (one array over `data`), so the tightest device bounds all.

        Args:
          stats: `Device.memory_stats()` of each device holding the pool (bytes).
          utilization: `gpu_memory_utilization` in (0, 1].
          page_bytes: one page's bytes on one device (`page_bytes`).
        """
        if not stats or any(s is None or "bytes_limit" not in s for s in stats):
            return None
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats if s is not None)
        return max(int(utilization * max(free, 0)) // page_bytes, 1)

    def gathered_bytes(self) -> int:
        """Device bytes `gathered` adds (k and v copies; per device inside `shard_map`)."""
        rows, width = self.page_table.shape
        # a pool's leading dims (L×)K, then rows × width pages of S×D
        copy = lambda x: math.prod(x.shape[:-3]) * rows * width * math.prod(x.shape[-2:])  # noqa: E731
        return 2 * sum(copy(x) * x.dtype.itemsize for x in jax.tree.leaves(self.k))

    def gathered(self) -> PagedKVCache:
        """The cache with `k_seq`/`v_seq` gathered from the pools, every layer's (stacked
        pools: one gather into an L×K×B×(P·S)×D array). The jnp path of the decode loop does
        it once per jitted call while the copy is small (`steps.MAX_GATHERED_BYTES`): a decode
        step then reads B×(P·S) keys in place instead of gathering them out of the pool, which
        XLA:CPU does at a fraction of its copy speed (the quick start's decode call: 1.3 s with
        the copy, 2.0 s gathering one block of pages at a time)."""
        gather = lambda pools: jax.tree.map(lambda p: gather_pages(p, self.page_table), pools)
        return dataclasses.replace(self, k_seq=gather(self.k), v_seq=gather(self.v))

    def attend(self, layer: Layer, q, k, v, positions, token_mask):
        """Writes the new keys/values k, v (B×T×K×D) of layer `layer` at `positions` (masked
        tokens write nowhere), then attends q (B×T×H×D) as `mode` says. Returns (B×T×H×D in
        q's dtype, the updated cache).

        `layer` is a Python int, or with stacked pools an int32 scalar (traced inside a scan
        over layers): the writes scatter into the stacked arrays and the reads gather (jnp) or
        load (Pallas) the layer's pages directly, no layer's pool is copied. Raises TypeError
        for per-layer pools and a traced layer."""
        (k_pool, at), (v_pool, _) = layer_of(self.k, layer), layer_of(self.v, layer)
        k_pool = write_pages(k_pool, k, self.page_table, positions, token_mask, at)
        v_pool = write_pages(v_pool, v, self.page_table, positions, token_mask, at)
        new = dataclasses.replace(
            self, k=with_layer(self.k, layer, k_pool), v=with_layer(self.v, layer, v_pool)
        )
        if self.batch_invariant:
            out = invariant.paged_attention(
                q, k_pool, v_pool, self.page_table, positions, self.sliding_window, at
            )
        elif self.mode == "prefill":
            mask = attention_mask(positions, positions, token_mask, self.sliding_window)
            out = dot_product_attention(q, k, v, mask)
        elif self.k_seq is not None and self.v_seq is not None:
            (k_seq, at), (v_seq, _) = layer_of(self.k_seq, layer), layer_of(self.v_seq, layer)
            k_seq = write_sequences(k_seq, k, positions, token_mask, at)
            v_seq = write_sequences(v_seq, v, positions, token_mask, at)
            # a stacked copy: the layer's K×B×(P·S)×D slice is read (a dynamic slice, which
            # XLA may copy: one layer's gathered keys/values per step, what attention reads)
            out = sequence_attention(
                q, read_layer(k_seq, at), read_layer(v_seq, at), positions, self.sliding_window
            )
            new = dataclasses.replace(
                new,
                k_seq=with_layer(self.k_seq, layer, k_seq),
                v_seq=with_layer(self.v_seq, layer, v_seq),
            )
        else:
            out = decode_attention(
                q, k_pool, v_pool, self.page_table, positions, kernel=self.impl,
                mesh=self.mesh, sliding_window=self.sliding_window, layer=at,
            )  # fmt: skip
        return out, new


def copy_pages(k_pools: Pools, v_pools: Pools, src_C: jax.Array, dst_C: jax.Array):
    """Copies page src[i] to page dst[i] in every layer (dst >= num_pages: skipped), per-layer
    or stacked pools alike (one gather and one scatter per stacked array).

    Used to give each sample of a prompt its own copy of the prompt's partly filled last page.
    The engine jits it with the pools donated (updated in place).
    """

    def copy(pool):  # pages are the third-last dimension in both layouts
        return pool.at[..., dst_C, :, :].set(pool[..., src_C, :, :], mode="drop")

    return jax.tree.map(copy, k_pools), jax.tree.map(copy, v_pools)
