"""The paged KV cache: a pool of fixed-size pages per layer and a page table per sequence.

Pool layout per layer: k, v of shape K×N×S×D (kv_heads × num_pages × page_size × head_dim),
the layout of the Pallas GPU kernel, so the pool is never transposed; kv_heads is the dimension
sharded over the `tensor` mesh axis. Position p of sequence b lives in page
`page_table[b, p // S]` at offset `p % S`.

`PagedKVCache` implements the cache protocol of `hybridjax.models.attention` (`attend`), so
`CausalLM.decode` runs on it unchanged. Two modes:
  * "prefill": queries attend to their own keys only (a prompt starts at position 0), and the
    keys/values are written to the pages;
  * "decode": the new keys/values are written first, then every query attends to its
    sequence's pages, causally by position: on the jnp path of the decode loop, a K×B×L×D
    copy of the sequences' pages gathered once per jitted call (`PagedKVCache.gathered`) and
    kept up to date step by step; otherwise `decode_attention.decode_attention` with the
    cache's kernel (the Pallas kernel, or the jnp gather at every step: the test oracle),
    inside `shard_map` on the cache's mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from hybridjax.models.attention import attention_mask, dot_product_attention
from hybridjax.rollout.decode_attention import decode_attention, gather_pages, sequence_attention


def write_pages(
    pages_KxNxSxD: jax.Array,
    new_BxTxKxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    token_mask_BxT: jax.Array,
) -> jax.Array:
    """Stores each valid token's key (or value) at its position; masked tokens write nowhere."""
    _, num_pages, page_size, _ = pages_KxNxSxD.shape
    page_BxT = jnp.take_along_axis(page_table_BxP, positions_BxT // page_size, axis=1)
    page_BxT = jnp.where(token_mask_BxT, page_BxT, num_pages)  # out of bounds: dropped
    offset_BxT = positions_BxT % page_size
    new_KxBxTxD = jnp.moveaxis(new_BxTxKxD, 2, 0).astype(pages_KxNxSxD.dtype)
    return pages_KxNxSxD.at[:, page_BxT, offset_BxT].set(new_KxBxTxD, mode="drop")


def write_sequences(
    seq_KxBxLxD: jax.Array, new_BxTxKxD: jax.Array, positions_BxT: jax.Array, token_mask_BxT
) -> jax.Array:
    """Stores each valid token's key (or value) at its position of a gathered K×B×L×D copy."""
    b, _ = positions_BxT.shape
    index_BxT = jnp.where(token_mask_BxT, positions_BxT, seq_KxBxLxD.shape[2])  # dropped
    new_KxBxTxD = jnp.moveaxis(new_BxTxKxD, 2, 0).astype(seq_KxBxLxD.dtype)
    return seq_KxBxLxD.at[:, jnp.arange(b)[:, None], index_BxT].set(new_KxBxTxD, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per-layer page pools plus the page tables of the sequences in this call.

    k, v: per layer K×N×S×D.  page_table: B×P int32 (rows of the batch being run).
    k_seq, v_seq: optional per-layer K×B×(P·S)×D copies of the rows' pages (`gathered`); when
      present, decode steps attend to them (and keep them up to date) instead of gathering the
      pages again at every step.
    mode: "prefill" or "decode" (see the module docstring). impl: "jnp" or "pallas", the
      decode kernel (`decode_attention.select_decode_kernel`).
    mesh: the generation mesh the decode kernel runs on per device (`decode_attention`), or
      None (one device, or left to the SPMD partitioner).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    mode: str = dataclasses.field(default="decode", metadata=dict(static=True))
    impl: str = dataclasses.field(default="jnp", metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    k_seq: tuple[jax.Array, ...] | None = None
    v_seq: tuple[jax.Array, ...] | None = None
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))

    @staticmethod
    def create_pool(config, num_pages: int, page_size: int, dtype=jnp.float32):
        """Zeroed pools (k, v), one K×N×S×D array per layer, for `config` (a ModelConfig)."""
        shape = (config.num_key_value_heads, num_pages, page_size, config.resolved_head_dim)
        layers = config.num_hidden_layers
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

    def gathered(self) -> PagedKVCache:
        """The cache with `k_seq`/`v_seq` gathered from the pools (the jnp decode path, once
        per jitted decode loop: a decode step then reads B×L keys in place instead of copying
        them out of the pool, which costs as much as the rest of a small model's step on CPU)."""
        gather = lambda pools: tuple(gather_pages(p, self.page_table) for p in pools)
        return dataclasses.replace(self, k_seq=gather(self.k), v_seq=gather(self.v))

    def attend(self, layer, q, k, v, positions, token_mask):
        k_pages = write_pages(self.k[layer], k, self.page_table, positions, token_mask)
        v_pages = write_pages(self.v[layer], v, self.page_table, positions, token_mask)
        new = dataclasses.replace(
            self, k=_put(self.k, layer, k_pages), v=_put(self.v, layer, v_pages)
        )
        if self.mode == "prefill":
            mask = attention_mask(positions, positions, token_mask, self.sliding_window)
            out = dot_product_attention(q, k, v, mask)
        elif self.k_seq is not None:
            k_seq = write_sequences(self.k_seq[layer], k, positions, token_mask)
            v_seq = write_sequences(self.v_seq[layer], v, positions, token_mask)
            out = sequence_attention(q, k_seq, v_seq, positions, self.sliding_window)
            new = dataclasses.replace(
                new, k_seq=_put(self.k_seq, layer, k_seq), v_seq=_put(self.v_seq, layer, v_seq)
            )
        else:
            out = decode_attention(
                q, k_pages, v_pages, self.page_table, positions, kernel=self.impl,
                mesh=self.mesh, sliding_window=self.sliding_window,
            )  # fmt: skip
        return out, new


def _put(layers: tuple, index: int, value) -> tuple:
    return layers[:index] + (value,) + layers[index + 1 :]


def copy_pages(k_pools, v_pools, src_C: jax.Array, dst_C: jax.Array):
    """Copies page src[i] to page dst[i] in every layer (dst >= num_pages: skipped).

    Used to give each sample of a prompt its own copy of the prompt's partly filled last page.
    The engine jits it with the pools donated (updated in place).
    """

    def copy(pool):
        return pool.at[:, dst_C].set(pool[:, src_C], mode="drop")

    return tuple(copy(p) for p in k_pools), tuple(copy(p) for p in v_pools)
