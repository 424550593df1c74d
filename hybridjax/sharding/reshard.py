"""`update_weights`: re-lay parameters from one layout into another (verl's weight sync).

The actor trains in the training layout (FSDP × tensor) and decodes in the generation layout
(tensor only, replicated over `data`). Moving between them is, per parameter, a jitted cast with
`out_shardings` = the destination sharding: XLA turns it into the collectives the two layouts
need (all-gather over fsdp, all-to-all when tensor groups change) and, when casting, converts
before it communicates, so a float32 → bfloat16 move sends half the bytes.

Memory: parameters move one leaf per program, and each device runs its programs in order, so
the peak is the source copy + the destination copy + the scratch of ONE leaf. XLA needs scratch
only when the gathered dimension is not the major one (e.g. the embedding, `embed` on fsdp
in its minor dimension): at most that leaf's destination shard (`move_memory_bytes` reports it;
the tests check it). With `donate=True` the source leaves are deleted in groups of `chunk_bytes`
as soon as their moves finish: peak ≈ max(source, destination) + one group, for a move whose
source is no longer needed (e.g. generation copy → training layout after an offload).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

# The trainer logs the wall time of the move as `timing_s/reshard` and the return value as this.
RESHARD_BYTES_METRIC = "perf/reshard_bytes"
DEFAULT_CHUNK_BYTES = 1 << 30


@functools.cache
def _mover(sharding: Sharding, dtype: Any):
    """A jitted `x -> x.astype(dtype)` laid out as `sharding`; one per (sharding, dtype),
    compiled once per distinct leaf shape. (No `donate_argnums`: XLA can reuse a donated buffer
    only when shard shapes agree, which a re-layout rarely has; sources are deleted instead.)"""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return jax.jit(cast, out_shardings=sharding)


def _bytes_per_device(array: jax.Array) -> int:
    """Bytes the array occupies summed over every device holding a shard (replicas count)."""
    shard_shape = array.sharding.shard_shape(array.shape)
    return int(np.prod(shard_shape)) * array.dtype.itemsize * len(array.sharding.device_set)


def update_weights(
    params: Any,
    shardings: Any,
    dtype: Any = None,
    *,
    donate: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[Any, int]:
    """Re-lays `params` out as `shardings`, optionally casting floating leaves to `dtype`.

    Args:
      params: pytree of `jax.Array`s — typically the actor's `nnx.State` in the training layout.
      shardings: matching pytree (or tree prefix) of destination `Sharding`s, e.g.
        `state_shardings(state, meshes.generate, ACTOR_GENERATE_RULES)`.
      dtype: destination dtype for floating-point leaves (e.g. `jnp.bfloat16` for decoding),
        or None to keep each leaf's dtype. Integer leaves are never cast.
      donate: delete each source leaf once moved (the source must not be used afterwards).
      chunk_bytes: with `donate`, wait for the moves dispatched so far after this many
        destination bytes and free their sources (one host sync per chunk).

    Returns:
      (the re-laid-out pytree, bytes written): the destination's bytes summed over every device
      that holds a shard (so a copy replicated 4× over `data` counts 4×). Log it as
      `perf/reshard_bytes`.

    Raises:
      ValueError: `shardings` does not match the structure of `params`.
    """
    leaves, treedef = jax.tree.flatten(params)
    try:
        targets = treedef.flatten_up_to(
            jax.tree.broadcast(shardings, params, is_leaf=lambda x: isinstance(x, Sharding))
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"shardings do not match the parameter tree: {err}") from err
    out, total, pending, sources = [], 0, 0, []
    for leaf, target in zip(leaves, targets, strict=True):
        floating = jax.numpy.issubdtype(leaf.dtype, np.floating)
        moved = _mover(target, dtype if dtype is not None and floating else None)(leaf)
        out.append(moved)
        size = _bytes_per_device(moved)
        total, pending = total + size, pending + size
        if donate:
            sources.append(leaf)
            if pending >= chunk_bytes:
                _release(moved, sources)
                pending, sources = 0, []
    out = jax.block_until_ready(out)
    _release(out, sources)
    return jax.tree.unflatten(treedef, out), total


def _release(moved: Any, sources: list[jax.Array]) -> None:
    """Waits for `moved` (host sync), then frees the device buffers of `sources`."""
    jax.block_until_ready(moved)
    for leaf in sources:
        leaf.delete()


def move_memory_bytes(leaf: jax.Array, sharding: Sharding, dtype: Any = None) -> dict[str, int]:
    """Per-device memory of moving one leaf, from XLA's compiled memory analysis (no execution):
    `argument`, `output` and `temp` (scratch) bytes. Used by the tests to bound peak memory."""
    stats = _mover(sharding, dtype).lower(leaf).compile().memory_analysis()
    return dict(
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
    )
