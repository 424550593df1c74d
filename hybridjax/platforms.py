"""Which platform a program is built for, read from its devices or from the mesh it is traced
under. The lowest layer of the package, beside `errors`: models, sharding, rollout and the
memory planner all ask it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh


def platform_of(devices: Mesh | Sequence[Any] | None = None) -> str:
    """The platform ("gpu", "tpu" or "cpu") of `devices` (a mesh or a device list), else of the
    mesh a jitted pass is being traced under (`sharding.mesh.pass_mesh`), else
    `jax.default_backend()`.

    Choices made while a program is built (the attention of full-sequence passes, the engine's
    decode kernel, the planner's target) read this rather than `jax.default_backend()`, so a
    program compiled for compile-only GPUs from a CPU process (`hybridjax.memory.gpu_targets`)
    takes the GPU's code paths. (`auto` dtypes and the compilation cache are resolved by the
    trainer for its own devices, and by the planner for its `--target`.)
    """
    if devices is None:  # the abstract mesh: readable while tracing too
        device = jax.sharding.get_abstract_mesh().abstract_device
        platform = device.platform if device is not None else jax.default_backend()
    elif isinstance(devices, Mesh):
        platform = devices.devices.flat[0].platform
    else:
        platform = devices[0].platform if len(devices) else jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform
