"""Dot-product attention with grouped-query heads, its masks, and the dense KV cache.

Full-sequence passes (training, log-probs, values) call `self_attention` under a
`SelfAttentionMask`; the implementation is chosen by backend (`attention_backend`): the dense
jnp path on CPU, the blocked path (`hybridjax.models.blocked_attention`, memory linear in
tokens) on GPU and TPU.

A KV cache is any pytree with the method

    attend(layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, positions_BxT, token_mask_BxT)
        -> (out_BxTxHxD, new_cache)

that stores the new keys/values of `layer` at their positions and attends the queries to every
cached key at a position <= the query's. `DenseKVCache` below is the simple one (a slot per
position); the rollout engine brings a paged one with the same method.

A cache stores its layers either one array each (`k`, `v` tuples; `layer` a Python int) or
stacked, one array with a leading layer axis L (`stacked_cache`): then `layer` may be a traced
int32 scalar, and a scanned model (`ModelConfig.scan_layers`) runs its decode as one scan with
the cache in the carry. `layer_slice` / `layer_update` read and write either form.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from hybridjax.models.blocked_attention import blocked_attention

NEG_INF = -1e30


def attention_mask(
    q_positions_BxT: jax.Array,
    k_positions_BxS: jax.Array,
    k_valid_BxS: jax.Array,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean mask B×T×S: key valid, causal by position, inside the sliding window (if any)."""
    q = q_positions_BxT[:, :, None]
    k = k_positions_BxS[:, None, :]
    mask = k_valid_BxS[:, None, :] & (k <= q)
    if sliding_window is not None:
        mask &= q - k < sliding_window
    return mask


def packed_attention_mask(
    segment_ids_BxT: jax.Array,
    prefix_ids_BxT: jax.Array,
    positions_BxT: jax.Array,
    valid_BxT: jax.Array,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean mask B×T×T of a packed buffer (`hybridjax.models.packing`): token i sees token j
    iff j is valid, j ≤ i by buffer index, and j is in i's own segment or in i's prefix segment
    (the shared prompt of a response), inside the sliding window by position (if any).

    Causality is by index, not position: positions restart at each sequence. A prompt's tokens
    carry their own segment as prefix, so a response sees its prompt and itself, never a sibling.
    """
    seg_k = segment_ids_BxT[:, None, :]
    same = (seg_k == segment_ids_BxT[:, :, None]) | (seg_k == prefix_ids_BxT[:, :, None])
    t = segment_ids_BxT.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    mask = same & causal[None] & valid_BxT[:, None, :]
    if sliding_window is not None:
        mask &= positions_BxT[:, :, None] - positions_BxT[:, None, :] < sliding_window
    return mask


def attention_backend() -> str:
    """The self-attention implementation of full-sequence passes on the platform of the mesh
    being traced under (`hybridjax.platforms.platform_of`: compile-only GPUs included), else of
    `jax.default_backend()`.

    * "jnp" on CPU: `grouped_attention` under one dense B×T×T bias built once per forward
      (fastest there; also the reference every other path is tested against);
    * "blocked" on GPU and TPU: `blocked_attention.blocked_attention`, the mask computed per
      key block from per-token ids, so memory grows with tokens, not tokens² (both dtypes).

    Not taken: cuDNN flash attention (`jax.nn.dot_product_attention`) expresses segments only
    as equal ids or sequence offsets, so a response seeing its group's prompt needs a
    materialised B×T×T bias (memory ∝ T²). Splash attention (TPU) likewise masks by equal
    segment ids and static masks; the prefix part as a second call merged by log-sum-exp
    needs the gradient of its log-sum-exp, which splash does not provide (its vjp raises
    "Higher-order AD not supported" with `save_residuals`). See docs/packing.md.
    """
    from hybridjax.platforms import platform_of  # noqa: PLC0415

    return "jnp" if platform_of() == "cpu" else "blocked"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfAttentionMask:
    """Who sees whom in a full-sequence pass, built once per forward (`create`) and shared by
    every layer: per-token ids, B×T each, plus the dense bias when `impl` is "jnp".

    segment_ids, prefix_ids: int32 (a padded batch: zeros, one segment per row).
    positions: int32 position ids.  valid: bool, False on padding / empty slots.
    bias: float32 B×T×T additive bias (`attention_bias`), or None (the "blocked" path).
    """

    segment_ids: jax.Array
    prefix_ids: jax.Array
    positions: jax.Array
    valid: jax.Array
    bias: jax.Array | None
    sliding_window: int | None = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        positions_BxT: jax.Array,
        valid_BxT: jax.Array,
        segments: tuple[jax.Array, jax.Array] | None = None,
        sliding_window: int | None = None,
        impl: str | None = None,
    ) -> SelfAttentionMask:
        """The mask of a padded batch (`segments` None: causal, positions increasing along
        each row over valid tokens) or of a packed buffer (`segments` = (segment ids, prefix
        ids), `packed_attention_mask`). `impl`: "jnp" or "blocked", default
        `attention_backend()`. Raises ValueError on another `impl`."""
        impl = impl or attention_backend()
        if impl not in ("jnp", "blocked"):
            raise ValueError(f"unknown attention impl {impl!r}; expected 'jnp' or 'blocked'")
        zeros = jnp.zeros(positions_BxT.shape, jnp.int32)
        segment_ids, prefix_ids = segments if segments is not None else (zeros, zeros)
        bias = None
        if impl == "jnp" and segments is not None:
            mask = packed_attention_mask(
                segment_ids, prefix_ids, positions_BxT, valid_BxT, sliding_window
            )
            bias = attention_bias(mask)
        elif impl == "jnp":
            mask = attention_mask(positions_BxT, positions_BxT, valid_BxT, sliding_window)
            bias = attention_bias(mask)
        return cls(segment_ids, prefix_ids, positions_BxT, valid_BxT, bias, sliding_window, impl)


def self_attention(
    q_BxTxHxD: jax.Array,
    k_BxTxKxD: jax.Array,
    v_BxTxKxD: jax.Array,
    mask: SelfAttentionMask,
    query_chunks: int = 1,
) -> jax.Array:
    """Attention of T tokens over themselves under `mask`, by the backend `mask.impl`:
    `grouped_attention` under the dense bias ("jnp", skipping the blocks above the diagonal
    in `query_chunks`), or `blocked_attention` ("blocked", memory linear in T). Returns
    B×K×T×G×D in q's dtype (query head h = k·G + g); outputs at invalid queries are garbage.
    """
    if mask.impl == "blocked":
        return blocked_attention(
            q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask.segment_ids, mask.prefix_ids,
            mask.positions, mask.valid, mask.sliding_window,
        )  # fmt: skip
    assert mask.bias is not None  # every mask but "blocked" carries its dense bias
    return grouped_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask.bias, query_chunks)


def attention_bias(mask_BxTxS: jax.Array) -> jax.Array:
    """Additive float32 bias B×T×S: 0 where `mask` is True, NEG_INF elsewhere.

    Adding it to the logits equals `where(mask, logits, NEG_INF)` (|logits| ≪ 1e30), and costs
    one add forward and nothing backward, where a select costs one each way per layer.
    """
    return jnp.where(mask_BxTxS, 0.0, NEG_INF).astype(jnp.float32)


def grouped_attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    bias_BxTxS: jax.Array,
    query_chunks: int = 1,
) -> jax.Array:
    """Softmax(q·kᵀ/√D + bias)·v with H query heads sharing K = H/G key/value heads (GQA).

    Returns B×K×T×G×D (query head h = k·G + g) in q's dtype: the layout both dot products
    produce without a transpose, which an output projection can contract directly. Logits and
    softmax are in float32. A query row whose bias is NEG_INF everywhere gets the mean of its
    keys' values (no NaN); `dot_product_attention` zeroes such rows.

    `query_chunks` > 1 (self-attention, S = T) splits the queries into that many contiguous
    chunks and lets each attend only to keys up to its own last index, skipping the blocks
    above the diagonal: (n−1)/2n of the logits, softmax and both products (3/8 at n = 4).
    Exact when every key after a query (by index) is masked for it, as with positions that
    increase along the row over valid tokens (left/right padding, `default_positions`); rows
    with no valid key may differ (both are garbage).
    """
    b, t, h, d = q_BxTxHxD.shape
    kv = k_BxSxKxD.shape[2]
    q = q_BxTxHxD.reshape(b, t, kv, h // kv, d)
    n = max(min(query_chunks, t), 1)
    outs = []
    for lo, hi in itertools.pairwise([t * i // n for i in range(n + 1)]):
        s = k_BxSxKxD.shape[1] if n == 1 else hi  # chunk [lo, hi) sees keys [0, hi)
        logits = jnp.einsum(
            "btkgd,bskd->bktgs", q[:, lo:hi], k_BxSxKxD[:, :s], preferred_element_type=jnp.float32
        )
        logits = logits * (d**-0.5) + bias_BxTxS[:, None, lo:hi, None, :s]
        probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxD.dtype)
        outs.append(jnp.einsum("bktgs,bskd->bktgd", probs, v_BxSxKxD[:, :s]))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=2)


def dot_product_attention(
    q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array, mask_BxTxS: jax.Array
) -> jax.Array:
    """Softmax(q·kᵀ/√D)·v under a boolean mask, H query heads sharing K = H/G kv heads (GQA).

    Logits and softmax are computed in float32; the output B×T×H×D has q's dtype. A query row
    with no valid key (a padding token) returns zeros rather than NaN.
    """
    b, t, h, d = q_BxTxHxD.shape
    out = grouped_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, attention_bias(mask_BxTxS))
    any_key_BxT = jnp.any(mask_BxTxS, axis=-1)
    out = jnp.where(any_key_BxT[:, None, :, None, None], out, 0.0)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def stacked_cache(cache) -> bool:
    """Whether `cache` stores its layers stacked (`cache.k` one array with a leading layer
    axis, not a tuple of per-layer arrays), so that `attend` takes a traced layer index."""
    return not isinstance(cache.k, tuple | list)


def layer_slice(layers, layer) -> jax.Array:
    """Layer `layer` of per-layer storage: a tuple of arrays (`layer` an int), or one array
    with a leading layer axis (`layer` an int or a traced int32 scalar)."""
    if isinstance(layers, tuple | list):
        return layers[layer]
    return lax.dynamic_index_in_dim(layers, layer, axis=0, keepdims=False)


def layer_update(layers, layer, value: jax.Array):
    """`layers` (as in `layer_slice`) with layer `layer` replaced by `value`; pure."""
    if isinstance(layers, tuple | list):
        return (*layers[:layer], value, *layers[layer + 1 :])
    return lax.dynamic_update_index_in_dim(layers, value.astype(layers.dtype), layer, axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """A dense cache: slot `p` of row `b` holds the key/value of position `p`.

    k, v: per layer B×S×K×D, a tuple of L arrays, or stacked as one L×B×S×K×D array
      (`stacked_cache`: what a scanned model decodes with).
    valid: B×S bool, True where a slot holds a token (shared by the layers).
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    valid: jax.Array
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(
        cls, config, batch: int, max_len: int, dtype=jnp.float32, stacked: bool | None = None
    ) -> DenseKVCache:
        """An empty cache for `config` (a ModelConfig), `batch` rows of `max_len` positions;
        stacked (one L×B×S×K×D array each for k and v) when `stacked`, by default when the
        model scans its layers (`config.scan_layers`)."""
        stacked = config.scan_layers if stacked is None else stacked
        shape = (batch, max_len, config.num_key_value_heads, config.resolved_head_dim)
        layers = config.num_hidden_layers
        if stacked:
            zeros: tuple[jax.Array, ...] | jax.Array = jnp.zeros((layers, *shape), dtype)
        else:
            zeros = tuple(jnp.zeros(shape, dtype) for _ in range(layers))
        return cls(
            k=zeros,
            v=zeros,
            valid=jnp.zeros((batch, max_len), bool),
            sliding_window=config.sliding_window,
        )

    def attend(self, layer, q, k, v, positions, token_mask):
        b, s = self.valid.shape
        # Padding tokens write nowhere (index s is out of bounds and dropped).
        idx = jnp.where(token_mask, positions, s)
        rows = jnp.arange(b)[:, None]
        k_cache, v_cache = layer_slice(self.k, layer), layer_slice(self.v, layer)
        k_cache = k_cache.at[rows, idx].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[rows, idx].set(v.astype(v_cache.dtype), mode="drop")
        valid = self.valid.at[rows, idx].set(True, mode="drop")
        k_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        mask = attention_mask(positions, k_pos, valid, self.sliding_window)
        out = dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
        new = dataclasses.replace(
            self,
            k=layer_update(self.k, layer, k_cache),
            v=layer_update(self.v, layer, v_cache),
            valid=valid,
        )
        return out, new
