"""Routed mixture-of-experts MLP (Qwen3-MoE), dropless, with expert parallelism.

A token's hidden state x goes to the `k` experts of highest router probability
(softmax(x · Wᵣᵀ) in float32; with `norm_topk_prob` the k probabilities are renormalised to sum
to 1) and the layer returns Σₖ pₖ · expertₖ(x), each expert a SwiGLU MLP — HF
`Qwen3MoeSparseMoeBlock`.

Experts are stacked weights: gate/up (E, D, F), down (E, F, D), logical axes `expert`,
`embed`, `mlp`. Routed rows are sorted by expert and run as one grouped matmul
(`jax.lax.ragged_dot`): no capacity, no dropped tokens, static shapes (N·k rows whatever the
routing).

Expert parallelism: when the context mesh (`jax.set_mesh`) has an `expert` axis of size > 1,
the expert computation runs inside `shard_map`: tokens are split over every mesh axis but
`tensor`, experts over `expert`, the expert width F over `tensor`. Each device all-gathers the
routed tokens of its `expert` group, runs its E/ep local experts on the rows routed to them
(rows routed elsewhere get zero weight), and a reduce-scatter over `expert` (plus a sum over
`tensor`) returns each token's combined output to the device it came from. This moves ep× the
bytes of a ragged all-to-all but keeps every shape static and the routing dropless; the grouped
matmul runs over all gathered rows. Without such a mesh the same function runs unpartitioned
(and GSPMD partitions it as it partitions any jnp code).

Router statistics (per-expert load and mean probability, for the load-balancing loss and
metrics) are recorded with `nnx.Module.sow` only under `with_router_stats`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from hybridjax.models.config import to_dtype

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"


def route(
    logits_NxE: jax.Array, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k softmax routing (HF `Qwen3MoeTopKRouter`).

    Returns (weights N×k in the logits' dtype, expert ids N×k int32, probabilities N×E float32).
    """
    probs = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(logits_NxE.dtype), ids.astype(jnp.int32), probs


def grouped_swiglu(x_MxD, ids_M, weights_M, gate_GxDxF, up_GxDxF, down_GxFxD) -> jax.Array:
    """Σ over rows of weight · SwiGLU_{expert id}(row): rows M×D, each to expert `ids_M` (ids
    outside [0, G) contribute zero). Sorts the rows by expert and runs three
    `jax.lax.ragged_dot`s; returns M×D in x's dtype, in the input row order."""
    g = gate_GxDxF.shape[0]
    valid = (ids_M >= 0) & (ids_M < g)
    ids_M = jnp.where(valid, ids_M, g)  # out-of-range rows sort last, outside every group
    order = jnp.argsort(ids_M, stable=True)
    sizes = jnp.zeros(g, jnp.int32).at[ids_M].add(1, mode="drop")
    xs = x_MxD[order]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate_GxDxF, sizes))
    h = h * jax.lax.ragged_dot(xs, up_GxDxF, sizes)
    ys = jax.lax.ragged_dot(h, down_GxFxD, sizes)
    y = jnp.zeros_like(ys).at[order].set(ys)
    return y * jnp.where(valid, weights_M, 0).astype(y.dtype)[:, None]


def _combine(x_NxD, ids_NxK, w_NxK, gate, up, down) -> jax.Array:
    """Each token's weighted sum over its k experts (N×D), all experts local."""
    n, k = ids_NxK.shape
    rows = jnp.repeat(x_NxD, k, axis=0)  # row i·k + j is token i's j-th choice
    y = grouped_swiglu(rows, ids_NxK.reshape(-1), w_NxK.reshape(-1), gate, up, down)
    return y.reshape(n, k, -1).sum(axis=1)


def _expert_parallel_mesh(num_experts: int):
    """The context mesh if it has an `expert` axis of size > 1, else None. Raises ValueError
    when that axis does not divide `num_experts`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names or mesh.shape[EXPERT_AXIS] == 1:
        return None
    if num_experts % mesh.shape[EXPERT_AXIS]:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the {EXPERT_AXIS!r} mesh axis "
            f"({mesh.shape[EXPERT_AXIS]})"
        )
    return mesh


def _sharded_combine(mesh, x_NxD, ids_NxK, w_NxK, gate, up, down) -> jax.Array:
    """`_combine` under `shard_map`: tokens over every axis but `tensor`, experts over
    `expert`, the expert width over `tensor` (when it divides it)."""
    token_axes = tuple(a for a in mesh.axis_names if a != TENSOR_AXIS)
    tp = mesh.shape.get(TENSOR_AXIS, 1)
    tensor = TENSOR_AXIS if tp > 1 and gate.shape[-1] % tp == 0 else None
    shards = math.prod(mesh.shape[a] for a in token_axes)
    n = x_NxD.shape[0]
    pad = -n % shards
    if pad:  # pad rows route with zero weight
        x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
        ids_NxK, w_NxK = (jnp.pad(a, ((0, pad), (0, 0))) for a in (ids_NxK, w_NxK))
    local_experts = gate.shape[0] // mesh.shape[EXPERT_AXIS]

    def body(x, ids, w, gate, up, down):
        x, ids, w = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True) for a in (x, ids, w))
        first = jax.lax.axis_index(EXPERT_AXIS) * local_experts
        y = _combine(x, ids - first, w, gate, up, down)
        if tensor:
            y = jax.lax.psum(y, tensor)
        return jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)

    rows = P(token_axes, None)
    y = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            rows,
            rows,
            rows,
            P(EXPERT_AXIS, None, tensor),
            P(EXPERT_AXIS, None, tensor),
            P(EXPERT_AXIS, tensor, None),
        ),
        out_specs=rows,
    )(x_NxD, ids_NxK, w_NxK, gate, up, down)
    return y[:n]


def _param(rngs: nnx.Rngs, shape, axes, dtype, std: float) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype), axes=axes)


class Experts(nnx.Module):
    """E stacked SwiGLU experts (HF `mlp.experts.{e}.{gate,up,down}_proj`)."""

    def __init__(self, num_experts: int, d: int, f: int, param_dtype, std: float, rngs):
        self.gate_proj = _param(
            rngs, (num_experts, d, f), ("expert", "embed", "mlp"), param_dtype, std
        )
        self.up_proj = _param(
            rngs, (num_experts, d, f), ("expert", "embed", "mlp"), param_dtype, std
        )
        self.down_proj = _param(
            rngs, (num_experts, f, d), ("expert", "mlp", "embed"), param_dtype, std
        )


class MoEMLP(nnx.Module):
    """Qwen3-MoE sparse block: router `gate` (E, D) in HF's order, then `experts`; B×T×D → B×T×D.

    `replay_ids_BxTxK` (int32 expert ids, e.g. recorded by an earlier pass) replaces the
    router's top-k choice of each token whose k ids are all ≥ 0 (a token with a negative id
    keeps the router's choice: padding, or a token no pass recorded); the weights are still the
    router's probabilities of those experts (renormalised with `norm_topk_prob`), so gradients
    reach the router as usual.
    """

    def __init__(self, config, rngs: nnx.Rngs, std: float = 0.02):
        d, e = config.hidden_size, config.num_experts
        pd = to_dtype(config.param_dtype)
        self.gate = _param(rngs, (e, d), ("expert", "embed"), pd, std)
        self.experts = Experts(e, d, config.moe_intermediate_size, pd, std, rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.record = False

    def __call__(self, x_BxTxD, token_mask_BxT=None, replay_ids_BxTxK=None) -> jax.Array:
        b, t, d = x_BxTxD.shape
        dt = x_BxTxD.dtype
        x = x_BxTxD.reshape(b * t, d)
        logits = jnp.einsum("nd,ed->ne", x, self.gate[...].astype(dt))
        weights, ids, probs = route(logits, self.top_k, self.norm_topk_prob)
        if replay_ids_BxTxK is not None:
            replay = replay_ids_BxTxK.reshape(b * t, self.top_k).astype(jnp.int32)
            ids = jnp.where(jnp.all(replay >= 0, axis=-1, keepdims=True), replay, ids)
            top = jnp.take_along_axis(probs, ids, axis=-1)
            if self.norm_topk_prob:
                top = top / jnp.sum(top, axis=-1, keepdims=True)
            weights = top.astype(dt)
        if self.record:
            self._sow_stats(probs, ids, token_mask_BxT, (b, t))
        experts = self.experts
        w = tuple(
            a[...].astype(dt) for a in (experts.gate_proj, experts.up_proj, experts.down_proj)
        )
        mesh = _expert_parallel_mesh(w[0].shape[0])
        if mesh is None:
            y = _combine(x, ids, weights, *w)
        else:
            y = _sharded_combine(mesh, x, ids, weights, *w)
        return y.reshape(b, t, d)

    def _sow_stats(self, probs_NxE, ids_NxK, token_mask_BxT, bt) -> None:
        n, e = probs_NxE.shape
        mask = jnp.ones(n) if token_mask_BxT is None else token_mask_BxT.reshape(n)
        mask = mask.astype(jnp.float32)
        load = jnp.zeros(e).at[ids_NxK.reshape(-1)].add(jnp.repeat(mask, ids_NxK.shape[1]))
        self.sow(nnx.Intermediate, "expert_load", load)
        self.sow(nnx.Intermediate, "expert_prob", jnp.sum(probs_NxE * mask[:, None], axis=0))
        self.sow(nnx.Intermediate, "rows", jnp.sum(mask))
        self.sow(nnx.Intermediate, "expert_ids", ids_NxK.reshape(*bt, -1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """What the MoE layers of one forward recorded; L = MoE layers, E = experts.

    expert_load: L×E float32, routed (token, choice) pairs per expert over valid tokens;
    expert_prob: L×E float32, summed router probabilities over valid tokens;
    rows: L float32, valid tokens; expert_ids: L×B×T×k int32, the experts each token used.
    """

    expert_load: jax.Array
    expert_prob: jax.Array
    rows: jax.Array
    expert_ids: jax.Array

    def aux_loss(self) -> jax.Array:
        """Switch-Transformer load-balancing loss (Fedus et al. 2021, eq. 4) over all layers'
        tokens, as HF `load_balancing_loss_func`: E · Σₑ fₑ · Pₑ, with fₑ the routed pairs per
        token and Pₑ the mean router probability of expert e. float32 scalar (k when balanced
        uniformly, its minimum for a uniform router)."""
        total = jnp.maximum(jnp.sum(self.rows), 1.0)  # no valid token: 0, not NaN
        f = jnp.sum(self.expert_load, axis=0) / total
        p = jnp.sum(self.expert_prob, axis=0) / total
        return self.expert_load.shape[-1] * jnp.sum(f * p)

    def load_fraction(self) -> jax.Array:
        """E float32: each expert's share of the routed pairs (sums to 1; 1/E when balanced)."""
        load = jnp.sum(self.expert_load, axis=0)
        return load / jnp.maximum(jnp.sum(load), 1.0)

    def metrics(self) -> dict[str, jax.Array]:
        """float32 scalars: `moe_aux_loss` (`aux_loss`) and the largest and smallest share of
        one layer's routed pairs that one expert took, over layers and experts
        (`moe_expert_load_max` / `_min`; 1/E each when balanced). The layer is dropless, so no
        token is ever dropped and there is no dropped-token count."""
        per_layer = self.expert_load / jnp.maximum(
            jnp.sum(self.expert_load, axis=-1, keepdims=True), 1.0
        )
        return {
            "moe_aux_loss": self.aux_loss(),
            "moe_expert_load_max": jnp.max(per_layer),
            "moe_expert_load_min": jnp.min(per_layer),
        }


def moe_layers(model: nnx.Module) -> list[MoEMLP]:
    """The `MoEMLP` blocks of `model` in layer order."""
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, MoEMLP)]


def with_router_stats(fn: Callable[..., Any]) -> Callable[..., tuple[Any, RouterStats | None]]:
    """`fn(model, *args)` → `(fn's result, RouterStats or None for a dense model)`: the MoE
    layers of `model` record their routing while `fn` runs (`nnx.capture`); works inside
    jitted code. Layers of a copy made inside `fn` by `nnx.merge` are not recorded."""

    def run(model: nnx.Module, *args, **kwargs):
        layers = moe_layers(model)
        for m in layers:
            m.record = True
        try:
            out, sown = nnx.capture(fn, nnx.Intermediate)(model, *args, **kwargs)
        finally:
            for m in layers:
                m.record = False
        if not layers:
            return out, None
        by_key: dict[str, list[jax.Array]] = {}
        for path, var in nnx.to_flat_state(sown):
            by_key.setdefault(str(path[-1]), []).append(var.get_value()[0])
        stack = lambda key: jnp.stack(by_key[key])
        stats = RouterStats(
            stack("expert_load"), stack("expert_prob"), stack("rows"), stack("expert_ids")
        )
        return out, stats

    return run
