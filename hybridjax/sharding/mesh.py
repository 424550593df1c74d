"""The two meshes of the hybrid engine, over one set of devices.

Training uses axes `("data", "expert", "fsdp", "tensor")`, generation `("data", "tensor")`. Both
are shaped from the config keys `mesh.train.{data,expert,fsdp,tensor}` and
`mesh.generate.{data,tensor}`, where one size per mesh may be -1 ("the rest of the devices"). Both
meshes cover the same devices in the same flat order — `jax.devices()`, which under
`jax.distributed` spans every process — so with equal tensor sizes a tensor-parallel group holds
the same devices in both layouts and the generation `data` axis is the training
`data × expert × fsdp` axes merged (verl's 3D-HybridEngine regrouping).

`expert` (expert parallelism, MoE models only) splits the experts' weights and, like `data`, the
batch: outside the MoE layers its ranks are data-parallel ranks (Megatron's and MaxText's
layout), so batch rows are split over `BATCH_AXES` = data × expert × fsdp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

TRAIN_AXES = ("data", "expert", "fsdp", "tensor")
GENERATE_AXES = ("data", "tensor")
BATCH_AXES = ("data", "expert", "fsdp")  # the training mesh axes batch rows are split over
# a training axis older configs may lack, with its size then
TRAIN_AXIS_DEFAULTS = {"expert": 1}


def resolve_sizes(sizes: Sequence[int], num_devices: int, name: str = "mesh") -> tuple[int, ...]:
    """Replaces a single -1 in `sizes` by the rest of `num_devices`.

    Example: `resolve_sizes((-1, 2, 2), 8) == (2, 2, 2)`.

    Raises:
      ValueError: more than one -1, a size that is 0 or below -1, or sizes that do not multiply
        to `num_devices`; the message names `name` and the sizes.
    """
    sizes = tuple(int(s) for s in sizes)
    free = sizes.count(-1)
    fixed = math.prod(s for s in sizes if s != -1)
    if free > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"{name} sizes {sizes}: use positive sizes and at most one -1")
    if free:
        if num_devices % fixed:
            raise ValueError(f"{name} sizes {sizes} do not divide the {num_devices} devices")
        sizes = tuple(num_devices // fixed if s == -1 else s for s in sizes)
    if math.prod(sizes) != num_devices:
        raise ValueError(f"{name} sizes {sizes} multiply to {math.prod(sizes)}, not {num_devices}")
    return sizes


def train_tuple(sizes: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """The sizes of `TRAIN_AXES` from a mapping of axis name → size (`expert` may be missing)."""
    get = lambda a: sizes[a] if a in sizes else TRAIN_AXIS_DEFAULTS[a]
    return tuple(int(get(a)) for a in TRAIN_AXES)  # type: ignore[return-value]


def batch_shards(sizes: Mapping[str, int]) -> int:
    """Batch shards of a training mesh's resolved axis sizes: data × expert × fsdp."""
    return math.prod(int(sizes.get(a, 1)) for a in BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes of the training and generation meshes (-1 = the rest of the devices).

    train: sizes of ("data", "expert", "fsdp", "tensor"); generate: sizes of ("data", "tensor").
    """

    train: tuple[int, int, int, int] = (1, 1, -1, 1)
    generate: tuple[int, int] = (-1, 1)

    def __post_init__(self):
        for name, sizes, axes in (
            ("train", self.train, TRAIN_AXES),
            ("generate", self.generate, GENERATE_AXES),
        ):
            if len(sizes) != len(axes):
                raise ValueError(f"MeshConfig.{name} {tuple(sizes)}: give the sizes of {axes}")

    @classmethod
    def from_config(cls, config: Any) -> MeshConfig:
        """From a ConfigDict (or dict) holding `mesh.train.{data,expert,fsdp,tensor}` (`expert`
        may be missing: 1) and `mesh.generate.{data,tensor}`; the argument may be the whole
        config or its `mesh` node."""
        mesh = config["mesh"] if "mesh" in config else config
        return cls(
            train=train_tuple(mesh["train"]),
            generate=tuple(int(mesh["generate"][a]) for a in GENERATE_AXES),  # type: ignore[arg-type]
        )

    def train_sizes(self, num_devices: int) -> dict[str, int]:
        """Resolved training axis sizes by name; raises ValueError when they do not fit."""
        return dict(
            zip(TRAIN_AXES, resolve_sizes(self.train, num_devices, "mesh.train"), strict=True)
        )

    def generate_sizes(self, num_devices: int) -> dict[str, int]:
        """Resolved generation axis sizes by name; raises ValueError when they do not fit."""
        sizes = resolve_sizes(self.generate, num_devices, "mesh.generate")
        return dict(zip(GENERATE_AXES, sizes, strict=True))


@dataclasses.dataclass(frozen=True)
class HybridMeshes:
    """The training and generation meshes over the same devices."""

    train: Mesh
    generate: Mesh

    def mesh_for(self, layout: str) -> Mesh:
        """`"train"` or `"generate"` → that mesh; raises ValueError naming both otherwise."""
        if layout not in ("train", "generate"):
            raise ValueError(f"unknown layout {layout!r}; expected 'train' or 'generate'")
        return getattr(self, layout)


def _mesh(devices: np.ndarray, names: tuple[str, ...]) -> Mesh:
    # Auto axes: shardings are hints to the partitioner (JAX 0.10's `make_mesh` defaults to
    # Explicit axes, which would change how every model op type-checks).
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def make_meshes(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> HybridMeshes:
    """Builds both meshes over `devices` (default `jax.devices()`: every process's devices).

    The training mesh takes the device order of `jax.experimental.mesh_utils.create_device_mesh`
    (topology-aware on TPU/GPU, plain order on CPU); the generation mesh reshapes the same flat
    order, so tensor groups line up when both meshes have the same tensor size.

    Raises:
      ValueError: sizes that do not multiply to the device count (see `resolve_sizes`).
    """
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    train = tuple(config.train_sizes(len(devices)).values())
    generate = tuple(config.generate_sizes(len(devices)).values())
    train_devices = mesh_utils.create_device_mesh(train, devices, allow_split_physical_axes=True)
    generate_devices = train_devices.reshape(-1).reshape(generate)
    return HybridMeshes(
        train=_mesh(train_devices, TRAIN_AXES), generate=_mesh(generate_devices, GENERATE_AXES)
    )


def pass_mesh(mesh: Mesh) -> contextlib.AbstractContextManager[Any]:
    """`jax.set_mesh(mesh)` when `mesh` spans more than one device, else a null context.

    Enter it around a jitted pass (its call, so tracing sees the mesh): the MoE layers
    (`hybridjax.models.moe`) then run their experts in `shard_map` over the `expert` axis,
    and scanned decoder layers keep their rows split over the batch axes
    (`hybridjax.models.decoder.scan_layers`: one layer's weights gathered per step).
    """
    if mesh.size > 1:
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """Product of the sizes of `axes` in `mesh` (1 for None)."""
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    shape: Mapping[str, int] = mesh.shape
    return math.prod(shape[a] for a in names)
