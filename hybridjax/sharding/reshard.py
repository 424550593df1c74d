"""`update_weights`: re-lay parameters from one layout into another (verl's weight sync).

The actor trains in the training layout (FSDP × tensor) and decodes in the generation layout
(tensor only, replicated over `data`). Moving between them is, per parameter, a jitted cast with
`out_shardings` = the destination sharding: XLA turns it into the collectives the two layouts
need (all-gather over fsdp, all-to-all when tensor groups change) and, when casting, converts
before it communicates, so a float32 → bfloat16 move sends half the bytes.

Memory: parameters move one leaf at a time, waiting for each group of `chunk_bytes` before
dispatching the next. Peak device memory is therefore the source copy + the destination copy +
one in-flight group (the collectives of a single leaf need no scratch beyond its output on the
backends we measured; `move_memory_bytes` reports it). With `donate=True` the source leaves are
freed as they move: peak ≈ max(source, destination) + one group, for a move back to the
training layout after generation when the generation copy is no longer needed.
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
def _mover(sharding: Sharding, dtype: Any, donate: bool):
    """A jitted `x -> x.astype(dtype)` laid out as `sharding`; one per (sharding, dtype, donate),
    compiled once per distinct leaf shape."""
    cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
    return jax.jit(cast, out_shardings=sharding, donate_argnums=(0,) if donate else ())


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
      donate: free each source leaf once moved (the source must not be used afterwards).
      chunk_bytes: wait for the moves dispatched so far after this many destination bytes;
        bounds the memory in flight. Host sync once per chunk.

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
    out, total, pending = [], 0, 0
    for leaf, target in zip(leaves, targets, strict=True):
        cast = (
            dtype if dtype is not None and jax.numpy.issubdtype(leaf.dtype, np.floating) else None
        )
        moved = _mover(target, cast, donate)(leaf)
        out.append(moved)
        size = _bytes_per_device(moved)
        total, pending = total + size, pending + size
        if pending >= chunk_bytes:
            jax.block_until_ready(moved)  # host sync: bounds the moves in flight
            pending = 0
    out = jax.block_until_ready(out)
    return jax.tree.unflatten(treedef, out), total


def move_memory_bytes(leaf: jax.Array, sharding: Sharding, dtype: Any = None) -> dict[str, int]:
    """Per-device memory of moving one leaf, from XLA's compiled memory analysis (no execution):
    `argument`, `output` and `temp` (scratch) bytes. Used by the tests to bound peak memory."""
    stats = _mover(sharding, dtype, False).lower(leaf).compile().memory_analysis()
    return dict(
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes,
    )
