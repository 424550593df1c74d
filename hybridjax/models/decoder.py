"""One decoder-only transformer for the Qwen2 / Qwen3 / Qwen3-MoE / Llama / Mistral families, in
Flax NNX. Family differences are config flags: Qwen3's q/k norm (`Attention`), Qwen3-MoE's routed
experts (`hybridjax.models.moe`).

The module tree mirrors HF's parameter names (`model.layers.3.self_attn.q_proj`, `lm_head`,
`score`) so that checkpoint I/O is a rename plus a reshape. Every parameter carries the logical
axis names of its dimensions in its `axes` metadata; `hybridjax.sharding` maps them to mesh axes.

Logical axes: `vocab`, `embed` (model width), `heads`, `kv_heads`, `head_dim`, `mlp`, `norm`
(RMSNorm scales, always replicated), `label` (classifier outputs), `expert` (MoE experts) and
`layers` (the leading axis of a scanned model's stacked layer parameters, replicated).

Scanned layers (`ModelConfig.scan_layers`): `model.layers` is one `DecoderLayer` whose every
parameter holds the L layers' values stacked (`model.layers.self_attn.q_proj` of shape
(L, D, H, Dh)), drawn as the per-layer model's from the same `nnx.Rngs`; `stack_layer_state` /
`unstack_layer_state` convert states between the two forms, and `scan_layers` runs them.

Two call paths share one implementation:
  * full sequences with a padding mask and position ids (training, log-probs, values), whose
    positions increase along each row over valid tokens (left or right padding with
    `default_positions`): a query never attends to a later token, which lets attention skip
    the blocks above the diagonal; or packed buffers (`segments`: several sequences end to
    end, responses sharing their prompt, `hybridjax.models.packing`), causal by index;
  * incremental decoding against an external KV cache (`hybridjax.models.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

from hybridjax.models import invariant
from hybridjax.models.attention import SelfAttentionMask, self_attention, stacked_cache
from hybridjax.models.config import ModelConfig, to_dtype
from hybridjax.models.moe import MoEMLP

ModuleT = TypeVar("ModuleT", bound=nnx.Module)  # a module class, kept through a transform
INIT_STD = 0.02
# Full-sequence attention on the jnp path splits the queries into up to MAX_QUERY_CHUNKS chunks
# of at least MIN_QUERY_CHUNK tokens and skips the key blocks above the diagonal
# (`attention.grouped_attention`):
# measured forward+backward of one attention block at 32×249 tokens, one thread: 325 ms
# unsplit, 294 ms in 2 chunks, 289 ms in 4, 303 ms in 6.
MAX_QUERY_CHUNKS = 4
MIN_QUERY_CHUNK = 64
# The MLP runs gate and up as one stacked matmul when a call has at least this many tokens per
# unit of width (B·T ≥ ratio · hidden_size); see `MLP`.
STACKED_GATE_UP_MIN_TOKENS_PER_WIDTH = 4


def _param(rngs: nnx.Rngs, shape, axes, dtype, init="normal") -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape)).astype(dtype)
    return nnx.Param(value, axes=axes)


def default_positions(token_mask_BxT: jax.Array) -> jax.Array:
    """Position ids for a (left- or right-) padded batch: 0 at each row's first valid token."""
    return jnp.maximum(jnp.cumsum(token_mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def rope_frequencies(config: ModelConfig) -> jax.Array:
    """Inverse frequencies (head_dim/2,), float32, with `linear` or `llama3` scaling applied.

    llama3 scaling follows HF `_compute_llama3_parameters` (Llama 3.1 report): low frequencies
    divided by `factor`, high ones kept, a smooth blend between.
    """
    d = config.resolved_head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    scaling = config.rope_scaling_dict
    if not scaling or scaling["rope_type"] == "default":
        return inv
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions_BxT: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each float32 B×T×1×D/2, of positions × inverse frequencies; computed once per
    forward and shared by every layer."""
    angles = positions_BxT[..., None].astype(jnp.float32) * inv_freq  # B×T×D/2
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x_BxTxHxD: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding in HF's rotate-half convention (first half / second half pairs), with
    the (cos, sin) tables of `rope_tables`."""
    cos, sin = (t.astype(x_BxTxHxD.dtype) for t in rope)
    x1, x2 = jnp.split(x_BxTxHxD, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich 2019), statistics in float32 as HF;
    per fixed tile of rows with `batch_invariant` (`invariant.rms_norm`)."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs, batch_invariant=False):
        self.weight = _param(rngs, (dim,), ("norm",), param_dtype, init="ones")
        self.eps = eps
        self.batch_invariant = batch_invariant

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.batch_invariant:
            return invariant.rms_norm(x, self.weight[...], self.eps)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention (Ainslie et al. 2023) with RoPE; x B×T×D → B×T×D.

    Projections are stored per head: q (D,H,Dh), k/v (D,K,Dh), o (H,Dh,D). With `cache` the new
    keys and values go through `cache.attend` (dense or paged); without, the T tokens attend to each
    other under `mask` (a `SelfAttentionMask`: causal, padding, segments, sliding window), by the
    backend's implementation (`attention.self_attention`).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, h, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        hd = config.resolved_head_dim
        pd = to_dtype(config.param_dtype)
        self.q_proj = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), pd)
        self.k_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), pd)
        if config.attention_bias:
            self.q_bias = _param(rngs, (h, hd), ("heads", "head_dim"), pd, init="zeros")
            self.k_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, init="zeros")
            self.v_bias = _param(rngs, (kv, hd), ("kv_heads", "head_dim"), pd, init="zeros")
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, pd, rngs, config.batch_invariant)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, pd, rngs, config.batch_invariant)
        self.config = config

    def _project(self, x, name):
        dtype = x.dtype
        w = getattr(self, f"{name}_proj")[...].astype(dtype)
        if self.config.batch_invariant:
            y = invariant.matmul(x, w)
        else:
            y = jnp.einsum("btd,dhk->bthk", x, w)
        if self.config.attention_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dtype)
        return y

    def __call__(self, x_BxTxD, positions_BxT, token_mask_BxT, rope, mask, cache=None, layer=0):
        q, k = self._project(x_BxTxD, "q"), self._project(x_BxTxD, "k")
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = self._project(x_BxTxD, "v")
        dtype = x_BxTxD.dtype
        o = self.o_proj[...].astype(dtype)
        if self.config.batch_invariant:  # parity mode: one reduction order, any batch
            if cache is None:
                out = invariant.self_attention(
                    q, k, v, mask.positions, mask.valid, self.config.sliding_window
                )
            else:
                out, cache = cache.attend(layer, q, k, v, positions_BxT, token_mask_BxT)
            out = out.astype(dtype).reshape(*out.shape[:2], -1)
            return invariant.matmul(out, o.reshape(-1, o.shape[-1])), cache
        if cache is None:
            # B×K×T×G×Dh against o (K,G,Dh,D): no transpose back to B×T×H×Dh.
            chunks = min(MAX_QUERY_CHUNKS, max(q.shape[1] // MIN_QUERY_CHUNK, 1))
            out = self_attention(q, k, v, mask, chunks).astype(dtype)
            kv = self.config.num_key_value_heads
            o = o.reshape(kv, o.shape[0] // kv, *o.shape[1:])
            return jnp.einsum("bktgh,kghd->btd", out, o), cache
        out, cache = cache.attend(layer, q, k, v, positions_BxT, token_mask_BxT)
        return jnp.einsum("bthk,hkd->btd", out.astype(dtype), o), cache


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(x·gate) ⊙ x·up); B×T×D → B×T×D."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = config.hidden_size, config.intermediate_size, to_dtype(config.param_dtype)
        self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), pd)
        self.batch_invariant = config.batch_invariant

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = x.dtype
        down = self.down_proj[...].astype(dt)
        if self.batch_invariant:  # three tiled matmuls whatever the token count
            gate = jax.nn.silu(invariant.matmul(x, self.gate_proj[...].astype(dt)))
            return invariant.matmul(gate * invariant.matmul(x, self.up_proj[...].astype(dt)), down)
        tokens = math.prod(x.shape[:-1])
        if tokens < STACKED_GATE_UP_MIN_TOKENS_PER_WIDTH * x.shape[-1]:
            gate = jax.nn.silu(x @ self.gate_proj[...].astype(dt))
            return (gate * (x @ self.up_proj[...].astype(dt))) @ down
        # Many tokens: gate and up as one matmul over the weights stacked on a new leading
        # axis. On XLA CPU the backward of two separate matmuls writes the SiLU gradient
        # transposed; stacking costs weight-sized copies instead. Measured forward+backward of
        # this block, one thread: 7968 tokens × 256 × 688: 510 → 425 ms; 6144 × 768 × 2048:
        # 2760 → 2320 ms; but 768 × 768 × 2048: 285 → 290 ms. A new axis rather than a
        # concatenation along `mlp`, which adds collective-permutes when `mlp` is sharded.
        w = jnp.stack([self.gate_proj[...], self.up_proj[...]]).astype(dt)
        gate_up = jnp.einsum("btd,cdf->btcf", x, w)
        return (jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]) @ down


class DecoderLayer(nnx.Module):
    """Pre-norm block: h + attn(norm(h)), then + mlp(norm(h)). Returns (B×T×D, cache).
    The MLP of layer `layer` is routed experts when `config.is_moe_layer(layer)`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        pd = to_dtype(config.param_dtype)
        args = (config.hidden_size, config.rms_norm_eps, pd, rngs, config.batch_invariant)
        self.input_layernorm = RMSNorm(*args)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(*args)
        self.mlp = MoEMLP(config, rngs) if config.is_moe_layer(layer) else MLP(config, rngs)

    def __call__(self, h, positions, token_mask, rope, mask, cache=None, layer=0, replay=None):
        """`replay`: B×T×k expert ids for a MoE layer (`MoEMLP`'s `replay_ids_BxTxK`)."""
        a, cache = self.self_attn(
            self.input_layernorm(h), positions, token_mask, rope, mask, cache, layer
        )
        h = h + a
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoEMLP):
            return h + self.mlp(x, token_mask, replay), cache
        return h + self.mlp(x), cache


def remat(fn, config: ModelConfig):
    """`jax.checkpoint(fn)` under `config.remat_policy`: "full" saves nothing inside `fn`,
    "dots_with_no_batch_dims" saves its matmul outputs without a batch dimension
    (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`)."""
    policies = {
        "full": None,
        "dots_with_no_batch_dims": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }
    return jax.checkpoint(fn, policy=policies[config.remat_policy])


LAYER_AXIS = "layers"  # logical name of the leading axis of stacked layer parameters


def _with_layer_axis(variable: nnx.Variable, value: jax.Array) -> nnx.Variable:
    """`variable` holding `value` (its L stacked copies), `layers` prepended to its `axes`."""
    axes = variable.get_metadata().get("axes")
    if axes is None:
        return variable.replace(value)
    return variable.replace(value, axes=(LAYER_AXIS, *axes))


def _without_layer_axis(variable: nnx.Variable, value: jax.Array) -> nnx.Variable:
    """`variable` holding `value` (one of its layers), the leading `layers` axis name dropped."""
    axes = variable.get_metadata().get("axes")
    if axes is None or axes[:1] != (LAYER_AXIS,):
        return variable.replace(value)
    return variable.replace(value, axes=axes[1:])


def stack_modules(modules: Sequence[ModuleT]) -> ModuleT:
    """One module of the same structure as each of `modules` whose variables hold theirs stacked
    on a new leading axis (L = len(modules)), `layers` prepended to their `axes` metadata.

    Raises ValueError when the modules differ in structure (a dense / MoE mix, differing
    attributes): such a stack cannot run as one scan (`ModelConfig.scan_layers`)."""
    splits = [nnx.split(m) for m in modules]
    graphdef = splits[0][0]
    for i, (other, _) in enumerate(splits[1:], start=1):
        if other != graphdef:
            raise ValueError(
                f"scan_layers needs identical decoder layers; layer {i} differs from layer 0 "
                "(set actor_rollout_ref.model.scan_layers to 'false')"
            )
    flats = [dict(nnx.to_flat_state(state)) for _, state in splits]
    stacked = {
        path: _with_layer_axis(var, jnp.stack([f[path].get_value() for f in flats]))
        for path, var in flats[0].items()
    }
    return cast(ModuleT, nnx.merge(graphdef, nnx.from_flat_state(stacked)))


def module_at(stacked: nnx.Module, index) -> nnx.Module:
    """Layer `index` (an int or a traced int32 scalar) of a `stack_modules` module."""
    graphdef, state = nnx.split(stacked)
    one = jax.tree.map(
        lambda v: _without_layer_axis(v, v.get_value()[index]),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, one)


def _layer_path(path: tuple) -> int | None:
    """Where the layer index goes in a decoder-layer parameter's path (right after `layers`),
    or None for a parameter outside the layers."""
    return path.index(LAYER_AXIS) + 1 if LAYER_AXIS in path else None


def stack_layer_state(state: nnx.State) -> nnx.State:
    """A per-layer model's state (`model.layers.{i}.…`) in the stacked form of a scanned
    model's (`model.layers.…` with a leading L axis, `ModelConfig.scan_layers`): pure, the
    other variables kept as they are. Inverse of `unstack_layer_state`."""
    flat = dict(nnx.to_flat_state(state))
    out: dict[tuple, nnx.Variable] = {}
    groups: dict[tuple, dict[Any, nnx.Variable]] = {}
    for path, var in flat.items():
        at = _layer_path(path)
        if at is None:
            out[path] = var
        else:
            groups.setdefault((*path[:at], *path[at + 1 :]), {})[path[at]] = var
    for path, by_layer in groups.items():
        layers = [by_layer[i] for i in range(len(by_layer))]
        out[path] = _with_layer_axis(layers[0], jnp.stack([v.get_value() for v in layers]))
    return nnx.from_flat_state(out)


def unstack_layer_state(state: nnx.State) -> nnx.State:
    """A scanned model's state in the per-layer form (inverse of `stack_layer_state`)."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        at = _layer_path(path)
        if at is None:
            out[path] = var
            continue
        for i, value in enumerate(var.get_value()):
            out[(*path[:at], i, *path[at:])] = _without_layer_axis(var, value)
    return nnx.from_flat_state(out)


# The training mesh axes a pass splits batch rows over (`hybridjax.sharding.mesh.BATCH_AXES`).
ROW_AXES = ("data", "expert", "fsdp")


def _rows_split(h_BxTxD: jax.Array) -> jax.Array:
    """h constrained to its rows split over the context mesh's batch axes (`jax.set_mesh`, as
    the trainer's passes enter it), when there is one and they divide the rows.

    Inside a scan over stacked layers the partitioner otherwise meets each layer's
    FSDP-sharded weights (split over `fsdp` along the model width) with the rows also split
    over `fsdp`, and resolves the conflict by all-gathering the activations: every device then
    runs every row. Pinning the rows makes it all-gather one layer's weights per step instead
    (FSDP). The per-layer loop pins them too: XLA:GPU gathered the packed buffers' rows in the
    7B reward model's forward (15.1 GB of temp per device, 1.8 GB pinned)."""
    mesh = jax.sharding.get_abstract_mesh()  # inside shard_map its manual axes are not ours
    types = zip(mesh.axis_names, mesh.axis_types, strict=True)
    auto = {name for name, kind in types if kind == jax.sharding.AxisType.Auto}
    axes = tuple(a for a in ROW_AXES if a in auto and mesh.shape[a] > 1)
    if not axes or h_BxTxD.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return h_BxTxD
    spec = jax.sharding.PartitionSpec(axes)
    return jax.lax.with_sharding_constraint(h_BxTxD, spec)


def scan_layers(stacked, h_BxTxD: jax.Array, args: tuple, cache=None) -> tuple[jax.Array, Any]:
    """The L layers of `stacked` (a `stack_modules` DecoderLayer) applied in order to h
    (B×T×D) as one `jax.lax.scan` over their stored stacked parameters: one layer body is
    traced and compiled whatever the depth. `args`: (positions, token mask, rope tables,
    `SelfAttentionMask` or None), shared by every layer.

    Without a cache each step is rematerialised under the config's `remat_policy` when
    `config.remat`. With a cache (one storing its layers stacked, `attention.stacked_cache`)
    the cache rides in the carry and each step calls `cache.attend` with its layer index, a
    traced int32 scalar. Returns (h B×T×D, the updated cache or None)."""
    graphdef, state = nnx.split(stacked)
    config = stacked.self_attn.config

    def body(carry, xs):
        h, cache = carry
        layer_state, index = xs
        h = _rows_split(h) if cache is None else h  # a training pass, not the engine's
        h, cache = nnx.merge(graphdef, layer_state)(h, *args, cache, index)
        return (h, cache), None

    step = remat(body, config) if config.remat and cache is None else body
    layers = jnp.arange(config.num_hidden_layers, dtype=jnp.int32)
    return jax.lax.scan(step, (h_BxTxD, cache), (state, layers))[0]


class Transformer(nnx.Module):
    """The backbone (HF `model.`): embeddings, decoder layers, final norm → hidden states."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        pd = to_dtype(config.param_dtype)
        self.config = config
        self.embed_tokens = _param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), pd
        )
        layers = [DecoderLayer(config, rngs, i) for i in range(config.num_hidden_layers)]
        # scanned: ONE DecoderLayer holding the L layers' parameters stacked (the same draws)
        self.layers = stack_modules(layers) if config.scan_layers else nnx.List(layers)
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, pd, rngs, config.batch_invariant
        )

    def __call__(
        self,
        input_ids_BxT,
        positions_BxT,
        token_mask_BxT,
        cache=None,
        segments=None,
        routed_experts_BxTxLxK=None,
    ):
        """Hidden states B×T×D in the compute dtype, and the updated cache (or None).

        With `config.scan_layers` the layers' parameters are stored stacked (`self.layers` is
        one DecoderLayer whose parameters have a leading L axis, logical axis `layers`) and
        the layers run as one scan over them (`scan_layers`), with or without a cache; a
        cache that stores its layers one array each (a tuple) is run layer by layer instead.

        `routed_experts_BxTxLxK` (int32, L = MoE layers in order, k = experts per token): the
        experts each token uses in each MoE layer instead of the router's choice (routing
        replay; negative ids: the router's own choice, see `MoEMLP`).

        Without a cache, positions must increase along each row over valid tokens (see the
        module docstring); outputs at padding positions are garbage. `segments` (int32
        segment ids, prefix segment ids), each B×T, marks a packed buffer: attention follows
        `attention.packed_attention_mask` instead.
        """
        dtype = to_dtype(self.config.dtype)
        h = jnp.take(self.embed_tokens[...], input_ids_BxT, axis=0).astype(dtype)
        rope = rope_tables(positions_BxT, rope_frequencies(self.config))
        token_mask_BxT = token_mask_BxT.astype(bool)
        mask = None  # one mask for every layer; with a cache, the cache masks
        if cache is None:
            window = self.config.sliding_window
            # parity mode reads the per-token ids only: no dense bias ("blocked" holds none)
            impl = "blocked" if self.config.batch_invariant else None
            if self.config.batch_invariant and segments is not None:
                raise ValueError(
                    "batch_invariant covers padded batches, not packed ones: set "
                    "actor_rollout_ref.model.use_remove_padding to false"
                )
            mask = SelfAttentionMask.create(positions_BxT, token_mask_BxT, segments, window, impl)
        if self.config.scan_layers and (cache is None or stacked_cache(cache)):
            args = (positions_BxT, token_mask_BxT, rope, mask)
            h, cache = scan_layers(self.layers, h, args, cache)
            return self.norm(h), cache
        moe_index = 0
        for i, layer in enumerate(self.layer_list()):
            h = _rows_split(h) if cache is None else h  # as `scan_layers`: rows stay split
            replay = None
            if routed_experts_BxTxLxK is not None and isinstance(layer.mlp, MoEMLP):
                replay = routed_experts_BxTxLxK[:, :, moe_index]
                moe_index += 1
            if self.config.remat and cache is None:
                # jax.checkpoint over the layer's split state: nnx.remat on the module fails
                # inside lax.map / lax.scan bodies (micro-batched passes) with a trace error.
                # What the copy sows (MoE router statistics) is handed back to the layer.
                graphdef, state = nnx.split(layer)

                def run(st, x, replay, graphdef=graphdef):
                    copy = nnx.merge(graphdef, st)
                    y = copy(x, positions_BxT, token_mask_BxT, rope, mask, replay=replay)[0]
                    return y, nnx.state(copy, nnx.Intermediate)

                h, sown = remat(run, self.config)(state, h, replay)
                nnx.update(layer, sown)
            else:
                h, cache = layer(h, positions_BxT, token_mask_BxT, rope, mask, cache, i, replay)
        return self.norm(h), cache

    def layer_list(self) -> list[nnx.Module]:
        """The decoder layers one module each: the modules themselves, or views of the stored
        stack's layers when scanned (`module_at`)."""
        if isinstance(self.layers, DecoderLayer):
            return [module_at(self.layers, i) for i in range(self.config.num_hidden_layers)]
        return list(self.layers)  # type: ignore[call-overload]  # an nnx.List


class CausalLM(nnx.Module):
    """HF `*ForCausalLM`: backbone + LM head (tied to the embedding when configured)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.model = Transformer(config, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _param(
                rngs,
                (config.hidden_size, config.vocab_size),
                ("embed", "vocab"),
                to_dtype(config.param_dtype),
            )

    def head_weight(self) -> tuple[jax.Array, str]:
        """(LM head weight, its layout): the embedding (V, D) as "vd" when tied, else
        `lm_head` (D, V) as "dv"; in the parameter dtype."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens[...], "vd"
        return self.lm_head[...], "dv"

    def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
        """Logits B×T×V in float32 from hidden states (per fixed tile of rows with
        `batch_invariant`, `invariant.matmul`)."""
        if self.config.batch_invariant:
            weight, layout = self.head_weight()
            w = weight.astype(hidden_BxTxD.dtype)
            return invariant.matmul(hidden_BxTxD, w.T if layout == "vd" else w, jnp.float32)
        if self.config.tie_word_embeddings:
            w = self.model.embed_tokens[...].astype(hidden_BxTxD.dtype)
            out = jnp.einsum("btd,vd->btv", hidden_BxTxD, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head[...].astype(hidden_BxTxD.dtype)
            out = jnp.einsum("btd,dv->btv", hidden_BxTxD, w, preferred_element_type=jnp.float32)
        return out.astype(jnp.float32)

    def __call__(
        self, input_ids_BxT, attention_mask_BxT, positions_BxT=None, segments=None
    ) -> jax.Array:
        """Full-sequence forward. Returns float32 logits B×T×V (garbage at padding positions).
        `segments`: a packed buffer's (segment ids, prefix ids), see `Transformer`."""
        if positions_BxT is None:
            positions_BxT = default_positions(attention_mask_BxT)
        hidden, _ = self.model(input_ids_BxT, positions_BxT, attention_mask_BxT, segments=segments)
        return self.logits(hidden)

    def decode(self, input_ids_BxT, positions_BxT, token_mask_BxT, cache):
        """Incremental forward against a KV cache. Returns (float32 logits B×T×V, new cache)."""
        hidden, cache = self.model(input_ids_BxT, positions_BxT, token_mask_BxT, cache)
        return self.logits(hidden), cache


class SequenceClassifier(nnx.Module):
    """HF `*ForSequenceClassification` (`score.weight`): a scalar head for critic / reward model.
    With `config.score_bias`, HF `*ForTokenClassification` (`score.weight`, `score.bias`).

    `__call__` returns per-token scores B×T×num_labels (float32); the critic reads every response
    position, the reward model the last valid token (`last_token_scores`).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.model = Transformer(config, rngs)
        self.score = _param(
            rngs,
            (config.hidden_size, config.num_labels),
            ("embed", "label"),
            to_dtype(config.param_dtype),
        )
        if config.score_bias:
            pd = to_dtype(config.param_dtype)
            self.score_bias = _param(rngs, (config.num_labels,), ("label",), pd, init="zeros")

    def __call__(
        self, input_ids_BxT, attention_mask_BxT, positions_BxT=None, segments=None
    ) -> jax.Array:
        if positions_BxT is None:
            positions_BxT = default_positions(attention_mask_BxT)
        hidden, _ = self.model(input_ids_BxT, positions_BxT, attention_mask_BxT, segments=segments)
        w = self.score[...].astype(hidden.dtype)
        scores = jnp.einsum("btd,dl->btl", hidden, w, preferred_element_type=jnp.float32)
        if self.config.score_bias:
            scores = scores + self.score_bias[...].astype(jnp.float32)
        return scores

    def last_token_scores(self, input_ids_BxT, attention_mask_BxT) -> jax.Array:
        """Scores B×num_labels at each row's last valid token (HF's pooling for padded rows)."""
        scores = self(input_ids_BxT, attention_mask_BxT)
        t = attention_mask_BxT.shape[1]
        last = t - 1 - jnp.argmax(attention_mask_BxT[:, ::-1].astype(jnp.int32), axis=1)
        return jnp.take_along_axis(scores, last[:, None, None], axis=1)[:, 0]
