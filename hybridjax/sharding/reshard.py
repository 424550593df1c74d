"""`update_weights`: re-lay parameters from one layout into another (verl's weight sync).

The actor trains in the training layout (FSDP × tensor) and decodes in the generation layout
(tensor only, replicated over `data`). Moving between them is, per parameter, a jitted cast with
`out_shardings` = the destination sharding: XLA turns it into the collectives the two layouts
need (all-gather over fsdp, all-to-all when tensor groups change) and, when casting, converts
before it communicates, so a float32 → bfloat16 move sends half the bytes.

Memory and ordering: parameters move one leaf per program, and the next leaf is dispatched only
when the previous one has landed (a host sync per leaf, well under a millisecond against the
copy itself). So the peak is the source copy + the destination copy + the scratch of ONE leaf.
XLA needs scratch only when the gathered dimension is not the major one (e.g. the embedding,
`embed` on fsdp in its minor dimension): at most that leaf's destination shard
(`move_memory_bytes` reports it; the tests check it). One program over the whole tree was
slower on CPU and held scratch for several leaves at once (docs/benchmarks.md), and several
collective programs in flight at once can deadlock XLA's CPU collectives (their rendezvous
waits for device threads held by another program). With `donate=True` each source leaf is
deleted as soon as its move lands: peak ≈ max(source, destination) + one leaf, for a move whose
source is no longer needed.

With `forward=True` a leaf already in its destination layout and dtype (one device, or the
same layout both sides) is returned as it is: no program, no copy, no host sync. The result
then shares those buffers with `params` (XLA copies even an identity program's output), so
it is for a consumer done with them before `params` change: the synchronous rollout engine,
which reads them until the next actor update donates them and `reshard` brings the new ones.

LoRA (`hybridjax.models.lora`): when `params` holds adapters, each adapted weight is merged as it
moves (W + scale·A·B, computed in the jitted move, written straight into the destination
layout), and the destination's `LoRAScale` is 0: the generation copy is the merged model, with
no extra full copy beyond it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from hybridjax.models.lora import has_adapters, merge_plan, merged_weight

# The trainer logs the wall time of the move as `timing_s/reshard` and the return value as this.
RESHARD_BYTES_METRIC = "perf/reshard_bytes"


@functools.cache
def _mover(sharding: Sharding, dtype: Any):
    """A jitted `x -> x.astype(dtype)` laid out as `sharding`; one per (sharding, dtype),
    compiled once per distinct leaf shape. (No `donate_argnums`: XLA can reuse a donated buffer
    only when shard shapes agree, which a re-layout rarely has; sources are deleted instead.)"""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return jax.jit(cast, out_shardings=sharding)


@functools.cache
def _merging_mover(sharding: Sharding, dtype: Any):
    """A jitted `(w, a, b, scale) -> merged_weight(...).astype(dtype)` laid out as `sharding`."""
    cast = lambda x: x if dtype is None else x.astype(dtype)
    return jax.jit(lambda w, a, b, s: cast(merged_weight(w, a, b, s)), out_shardings=sharding)


def _lora_moves(params: Any, leaves: list) -> dict[int, Any]:
    """Leaf index -> what replaces it in the move of a LoRA state: (a, b, scale) for an adapted
    weight, a zero for the scale."""
    paths, _ = jax.tree_util.tree_flatten_with_path(params)
    index = {
        tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey)): i
        for i, (kp, _) in enumerate(paths)
    }
    plan, scale_path = merge_plan(params)
    scale = leaves[index[scale_path]]
    moves: dict[int, Any] = {index[scale_path]: jnp.zeros_like(scale)}
    for target, (a, b) in plan.items():
        moves[index[target]] = (leaves[index[a]], leaves[index[b]], scale)
    return moves


def _bytes_on_all_devices(array: jax.Array) -> int:
    """Bytes the array occupies summed over every device holding a shard (replicas count)."""
    shard_shape = array.sharding.shard_shape(array.shape)
    return int(np.prod(shard_shape)) * array.dtype.itemsize * len(array.sharding.device_set)


def _in_place(leaf: jax.Array, target: Sharding, cast: Any) -> bool:
    """Whether `leaf` already has `target`'s layout and the dtype `cast` (None: any)."""
    same_dtype = cast is None or leaf.dtype == jnp.dtype(cast)
    return same_dtype and leaf.sharding.is_equivalent_to(target, leaf.ndim)


def update_weights(
    params: Any,
    shardings: Any,
    dtype: Any = None,
    *,
    donate: bool = False,
    forward: bool = False,
) -> tuple[Any, int]:
    """Re-lays `params` out as `shardings`, optionally casting floating leaves to `dtype`.

    Args:
      params: pytree of `jax.Array`s — typically the actor's `nnx.State` in the training layout.
      shardings: matching pytree (or tree prefix) of destination `Sharding`s, e.g.
        `state_shardings(state, meshes.generate, ACTOR_GENERATE_RULES)`.
      dtype: destination dtype for floating-point leaves (e.g. `jnp.bfloat16` for decoding),
        or None to keep each leaf's dtype. Integer leaves are never cast.
      donate: delete each source leaf once moved (the source must not be used afterwards).
      forward: return leaves already in their destination layout and dtype as they are,
        sharing their buffers (see the module docstring); never deleted by `donate`.

    Returns:
      (the re-laid-out pytree, bytes written): the destination's bytes summed over every device
      that holds a shard (so a copy replicated 4× over `data` counts 4×; a forwarded leaf
      writes none). Log it as `perf/reshard_bytes`.

    Raises:
      ValueError: `shardings` does not match the structure of `params`.
    """
    leaves, treedef = jax.tree.flatten(params)
    try:
        # flatten_up_to is jaxlib's PyTreeDef method, missing from its stubs
        targets = treedef.flatten_up_to(  # type: ignore[attr-defined]
            jax.tree.broadcast(shardings, params, is_leaf=lambda x: isinstance(x, Sharding))
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"shardings do not match the parameter tree: {err}") from err
    lora = _lora_moves(params, leaves) if has_adapters(params) else {}
    out, total = [], 0
    for i, (leaf, target) in enumerate(zip(leaves, targets, strict=True)):
        floating = jnp.issubdtype(leaf.dtype, np.floating)
        cast = dtype if dtype is not None and floating else None
        if forward and i not in lora and _in_place(leaf, target, cast):
            out.append(leaf)  # already where and what the destination wants: nothing written
            continue
        if isinstance(lora.get(i), tuple):
            moved = _merging_mover(target, cast)(leaf, *lora[i])
        else:
            moved = _mover(target, cast)(lora.get(i, leaf))
        out.append(jax.block_until_ready(moved))  # host sync: one leaf in flight at a time
        total += _bytes_on_all_devices(moved)
        if donate and not lora:
            leaf.delete()
    if donate and lora:  # adapters are read by several merges: delete once all have landed
        for leaf in leaves:
            leaf.delete()
    return jax.tree.unflatten(treedef, out), total


def move_memory_bytes(leaf: jax.Array, sharding: Sharding, dtype: Any = None) -> dict[str, int]:
    """Per-device memory of moving one leaf, from XLA's compiled memory analysis (no execution):
    `argument`, `output` and `temp` (scratch) bytes. Used by the tests to bound peak memory."""
    stats = _mover(sharding, dtype).lower(leaf).compile().memory_analysis()
    return dict(
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
    )
