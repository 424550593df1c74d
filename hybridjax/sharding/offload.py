"""Offload to host memory and back (verl's param / optimizer offload, the rollout's sleep/wake).

Before generation the trainer may move the optimizer state and idle models out of device memory
so the KV page pool gets the room, and bring them back afterwards. An offloaded array keeps its
mesh and partition spec; only the sharding's memory kind changes (`"pinned_host"`, falling back to
`"unpinned_host"` on a backend without pinned host memory; JAX 0.10 on CPU has both). Values are
copied bit for bit.

Config keys (verl's): `actor_rollout_ref.actor.fsdp_config.param_offload`,
`actor_rollout_ref.actor.fsdp_config.optimizer_offload`, `actor_rollout_ref.ref.fsdp_config.
param_offload`, `actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload`,
`critic.model.fsdp_config.{param,optimizer}_offload`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

DEVICE_MEMORY = "device"


@functools.cache
def host_memory_kind() -> str:
    """`"pinned_host"` when the default device offers it, else `"unpinned_host"`.

    Raises:
      ValueError: the device has no host memory space at all (the message lists what it has).
    """
    kinds = [m.kind for m in jax.local_devices()[0].addressable_memories()]
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise ValueError(f"device {jax.local_devices()[0]} has no host memory space; it has {kinds}")


def _to_memory(tree: Any, kind: str) -> Any:
    def move(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.sharding.memory_kind == kind:
            return x
        return jax.device_put(x, x.sharding.with_memory_kind(kind))

    return jax.block_until_ready(jax.tree.map(move, tree))


def offload_to_host(tree: Any) -> Any:
    """Copies every `jax.Array` leaf of `tree` to host memory, same mesh and partition spec.

    Non-array leaves pass through. Drop the device copy (the input) to free its memory.
    Host sync: waits for the copies.
    """
    return _to_memory(tree, host_memory_kind())


def load_to_device(tree: Any) -> Any:
    """Copies every `jax.Array` leaf of `tree` back to device memory (inverse of
    `offload_to_host`; leaves already on the device are returned unchanged). Host sync."""
    return _to_memory(tree, DEVICE_MEMORY)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Which states of one role go to host memory while the rollout runs (verl's names)."""

    param_offload: bool = False
    optimizer_offload: bool = False

    @classmethod
    def from_config(cls, fsdp_config: Any) -> OffloadConfig:
        """From a role's `fsdp_config` node (ConfigDict or dict); missing keys are False."""
        get = fsdp_config.get if fsdp_config is not None else (lambda k, d: d)
        return cls(
            param_offload=bool(get("param_offload", False)),
            optimizer_offload=bool(get("optimizer_offload", False)),
        )
