"""Compile-only GPUs for the kernel's deviceless compile tests: A100-SXM4-80GB and H100-SXM-80GB
as XLA `GpuTargetConfigProto` text protos, from NVIDIA's published figures (the H100 proto as an
H100 SXM prints it, openxla/xla PR #25919). Needs the CUDA PJRT plugin (`jax-cuda12-plugin`,
`jax-cuda12-pjrt`, `nvidia-cuda-nvcc-cu12` for ptxas) and `jax_platforms` pinned to "cpu"
before any backend starts (else the plugin's init fails at cuInit)."""

from __future__ import annotations

import os

_DEVICES = {
    # name: (SMs, compute capability, memory bandwidth B/s, L2 bytes, shared memory per SM,
    #        opt-in shared memory per block, clock GHz, FP32 lanes per SM, memory bytes, name)
    "a100": (108, (8, 0), 2_039_000_000_000, 41_943_040, 167_936, 166_912, 1.41, 64,
             85_899_345_920, "NVIDIA A100-SXM4-80GB"),
    "h100": (132, (9, 0), 3_352_320_000_000, 52_428_800, 233_472, 232_448, 1.98, 128,
             84_929_347_584, "NVIDIA H100 80GB HBM3"),
}  # fmt: skip


def target_config(name: str) -> str:
    """The text proto of compile-only GPU `name` ("a100" or "h100"); the CUDA runtime and cuDNN
    versions from $AOT_CUDA_RUNTIME / $AOT_CUDNN (default 12.9.0 / 9.28.0, the cuda12 wheels)."""
    sms, (major, minor), bandwidth, l2, smem_sm, smem_optin, clock, fpus, memory, desc = _DEVICES[
        name
    ]
    rt = [int(x) for x in os.environ.get("AOT_CUDA_RUNTIME", "12.9.0").split(".")]
    dnn = [int(x) for x in os.environ.get("AOT_CUDNN", "9.28.0").split(".")]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem_sm} threads_per_core_limit: 2048 core_count: {sms}
  fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: {l2}
  clock_rate_ghz: {clock} device_memory_size: {memory}
  shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}
runtime_version {{ major: {rt[0]} minor: {rt[1]} patch: {rt[2]} }}
device_description_str: "{desc}"
"""


def compile_only_devices(name: str, n: int) -> list:
    """n compile-only devices of GPU `name` on one host. Raises RuntimeError/NotImplementedError
    without the CUDA plugin or when a backend already started without the "cpu" pin."""
    from jax.experimental import topologies  # noqa: PLC0415

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(name), topology=f"1x1x{n}"
    )
    return list(topo.devices)
