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
    sequence's pages, causally by position: the Pallas kernel on GPU; on other backends a
    K×B×L×D copy of the sequences' pages gathered once per jitted decode loop
    (`PagedKVCache.gathered`) and kept up to date step by step, or `paged_attention_jnp`
    (a gather at every step; the test oracle).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hybridjax.models.attention import NEG_INF, attention_mask, dot_product_attention


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


def gather_pages(pages_KxNxSxD: jax.Array, page_table_BxP: jax.Array) -> jax.Array:
    """Each sequence's pages laid end to end: K×B×(P·S)×D (key j of row b at index j)."""
    kv, _, page_size, d = pages_KxNxSxD.shape
    b, p = page_table_BxP.shape
    return pages_KxNxSxD[:, page_table_BxP].reshape(kv, b, p * page_size, d)


def write_sequences(
    seq_KxBxLxD: jax.Array, new_BxTxKxD: jax.Array, positions_BxT: jax.Array, token_mask_BxT
) -> jax.Array:
    """Stores each valid token's key (or value) at its position of a gathered K×B×L×D copy."""
    b, _ = positions_BxT.shape
    index_BxT = jnp.where(token_mask_BxT, positions_BxT, seq_KxBxLxD.shape[2])  # dropped
    new_KxBxTxD = jnp.moveaxis(new_BxTxKxD, 2, 0).astype(seq_KxBxLxD.dtype)
    return seq_KxBxLxD.at[:, jnp.arange(b)[:, None], index_BxT].set(new_KxBxTxD, mode="drop")


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
) -> jax.Array:
    """Attention of each query to its sequence's pages: a gather of P pages per sequence, then
    `sequence_attention`. Unused page-table entries may point anywhere (masked by position).
    Cost: gathers B×P×S×K×D per layer (the test oracle; the decode loop gathers once per call,
    see `PagedKVCache.gathered`)."""
    k_seq = gather_pages(k_pages_KxNxSxD, page_table_BxP)
    v_seq = gather_pages(v_pages_KxNxSxD, page_table_BxP)
    return sequence_attention(q_BxTxHxD, k_seq, v_seq, positions_BxT, sliding_window)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(i for i in range(1, min(n, limit) + 1) if n % i == 0)


def paged_attention_pallas(
    q_BxTxHxD: jax.Array,
    k_pages_KxNxSxD: jax.Array,
    v_pages_KxNxSxD: jax.Array,
    page_table_BxP: jax.Array,
    positions_BxT: jax.Array,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas GPU kernel (`jax.experimental.pallas.ops.gpu.paged_attention`), one query per
    sequence (T = 1). The kernel attends to keys 0 .. length-1 and does not scale q itself.

    Raises ImportError where the kernel module does not exist (the import is deferred so CPU
    installs of any JAX version never touch it).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged  # noqa: PLC0415

    b, t, h, d = q_BxTxHxD.shape
    if t != 1:
        raise ValueError(f"the Pallas paged-attention kernel takes one query per sequence, got {t}")
    p = page_table_BxP.shape[1]
    k_splits = _largest_divisor_at_most(p, 16)
    per_block = _largest_divisor_at_most(p // k_splits, 8)
    q = (q_BxTxHxD[:, 0] * (d**-0.5)).astype(k_pages_KxNxSxD.dtype)
    lengths = (positions_BxT[:, 0] + 1).astype(jnp.int32)
    out = pallas_paged.paged_attention(
        q,
        k_pages_KxNxSxD,
        v_pages_KxNxSxD,
        page_table_BxP.astype(jnp.int32),
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=per_block,
        interpret=interpret,
    )
    return out[:, None].astype(q_BxTxHxD.dtype)


def resolve_attention_impl(impl: str, sliding_window: int | None) -> str:
    """ "auto" → "pallas" on GPU (no sliding window: the kernel has none), else "jnp"."""
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and sliding_window is None:
        return "pallas"
    return "jnp"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Per-layer page pools plus the page tables of the sequences in this call.

    k, v: per layer K×N×S×D.  page_table: B×P int32 (rows of the batch being run).
    k_seq, v_seq: optional per-layer K×B×(P·S)×D copies of the rows' pages (`gathered`); when
      present, decode steps attend to them (and keep them up to date) instead of gathering the
      pages again at every step.
    mode: "prefill" or "decode" (see the module docstring). impl: "jnp" or "pallas" (decode).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    mode: str = dataclasses.field(default="decode", metadata=dict(static=True))
    impl: str = dataclasses.field(default="jnp", metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    k_seq: tuple[jax.Array, ...] | None = None
    v_seq: tuple[jax.Array, ...] | None = None

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
        elif self.impl == "pallas":
            out = paged_attention_pallas(q, k_pages, v_pages, self.page_table, positions)
        elif self.k_seq is not None:
            k_seq = write_sequences(self.k_seq[layer], k, positions, token_mask)
            v_seq = write_sequences(self.v_seq[layer], v, positions, token_mask)
            out = sequence_attention(q, k_seq, v_seq, positions, self.sliding_window)
            new = dataclasses.replace(
                new, k_seq=_put(self.k_seq, layer, k_seq), v_seq=_put(self.v_seq, layer, v_seq)
            )
        else:
            out = paged_attention_jnp(
                q, k_pages, v_pages, self.page_table, positions, self.sliding_window
            )
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
