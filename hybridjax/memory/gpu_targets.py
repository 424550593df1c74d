"""Compile-only GPUs: XLA:GPU's compiler, on a machine without a GPU.

JAX's CUDA PJRT plugin compiles for a GPU described by a `GpuTargetConfigProto` (text proto)
without opening one: `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=..., topology="1x1x<N>")` gives N compile-only devices; meshes built from them
lower and compile as on the GPUs (SPMD partitioning, fusion, scheduling, buffer assignment,
ptxas to cubins), and `compiled.memory_analysis()` gives XLA:GPU's per-device bytes. Nothing
runs. The process must keep JAX's own backend on CPU (`jax_platforms="cpu"`, set before any
backend starts): the plugin's runtime client would fail at `cuInit` without a driver.

The targets are NVIDIA's published figures for the SXM parts:

| target | GPU | compute capability | SMs | HBM | bandwidth | L2 | shared memory / SM |
|---|---|---|---|---|---|---|---|
| `a100` | A100-SXM4-80GB | 8.0 | 108 | 80 GiB | 2.04 TB/s | 40 MB | 164 KB |
| `h100` | H100-SXM-80GB (HBM3) | 9.0 | 132 | 79.1 GiB | 3.35 TB/s | 50 MB | 228 KB |

The wheels: `pip install 'hybridjax[gpu-aot]'` (`jax-cuda12-plugin`, `jax-cuda12-pjrt` at
the installed JAX version, `nvidia-cuda-nvcc-cu12` for ptxas). Without a device there is no
autotuning and no `cost_analysis()`: a compile tells memory and whether every op compiles,
not time (docs/gpu-planning.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

INSTALL = "pip install 'hybridjax[gpu-aot]'"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU's figures, as `GpuTargetConfigProto.gpu_device_info` names them."""

    description: str  # device_description_str: the name the driver reports
    compute_capability: tuple[int, int]
    core_count: int  # streaming multiprocessors
    fpus_per_core: int  # FP32 lanes per SM
    memory_bandwidth: int  # bytes/s
    l2_cache_size: int  # bytes
    shared_memory_per_core: int  # bytes per SM
    shared_memory_per_block_optin: int  # bytes, the most one block may opt in to
    clock_rate_ghz: float  # boost clock
    device_memory_size: int  # bytes

    def proto(self, runtime: tuple[int, int, int], dnn: tuple[int, int, int]) -> str:
        """The `GpuTargetConfigProto` text proto of this GPU, with the CUDA runtime and cuDNN
        versions the compiler is told the target has (those of the installed plugin)."""
        major, minor = self.compute_capability
        version = lambda v: f"{{ major: {v[0]} minor: {v[1]} patch: {v[2]} }}"
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {version(dnn)}
runtime_version {version(runtime)}
device_description_str: "{self.description}"
"""


TARGETS = {
    "a100": GpuTarget(
        description="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        core_count=108,
        fpus_per_core=64,
        memory_bandwidth=2_039_000_000_000,
        l2_cache_size=40 * 1024 * 1024,
        shared_memory_per_core=164 * 1024,
        shared_memory_per_block_optin=163 * 1024,
        clock_rate_ghz=1.41,
        device_memory_size=80 * 1024**3,
    ),
    "h100": GpuTarget(
        description="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        core_count=132,
        fpus_per_core=128,
        memory_bandwidth=3_352_320_000_000,
        l2_cache_size=50 * 1024 * 1024,
        shared_memory_per_core=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
        clock_rate_ghz=1.98,
        device_memory_size=84_929_347_584,  # what the driver reports of its 80 GB
    ),
}

# The CUDA runtime and cuDNN each plugin's wheels are built against (the compiler checks
# features by them): jax-cuda12-* 0.10.x → 12.9 / cuDNN 9.28; jax-cuda13-* → 13.0.
_PLUGINS = {
    "jax_cuda13_plugin": ((13, 0, 0), (9, 28, 0)),
    "jax_cuda12_plugin": ((12, 9, 0), (9, 28, 0)),
}


def installed_plugin() -> str | None:
    """The importable CUDA plugin module's name (cuda13 before cuda12), or None."""
    for name in _PLUGINS:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def missing_plugin(target: str) -> str | None:
    """One line saying what to install to compile for `target`, or None when it can."""
    if installed_plugin() is None:
        return (
            f"--target={target} compiles with XLA:GPU, which needs JAX's CUDA plugin: {INSTALL} "
            "(jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12 at your jax version)"
        )
    return None


def target_config(target: str) -> str:
    """The text proto of `target` ("a100" or "h100") for the installed plugin.

    Raises:
      ValueError: an unknown target, or no CUDA plugin installed (the message says what to
        install).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; expected one of {sorted(TARGETS)}")
    problem = missing_plugin(target)
    if problem:
        raise ValueError(problem)
    runtime, dnn = _PLUGINS[installed_plugin() or ""]
    return TARGETS[target].proto(runtime, dnn)


def compile_only_devices(target: str, n: int) -> list[Any]:
    """`n` compile-only devices of `target` on one host, for meshes to lower and compile on.

    The process's JAX backend must be CPU (`jax.config.update("jax_platforms", "cpu")` before
    any backend starts), else the plugin tries to open a GPU and fails at `cuInit`.

    Raises:
      ValueError: as `target_config`.
    """
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(target), topology=f"1x1x{n}"
    )
    return list(topo.devices)
