"""The Pallas decode kernel compiled by XLA:GPU and ptxas for compile-only A100s (sm_80) and
H100s (sm_90) on this CPU machine: at the 7B shapes a 512 + 1024 rollout compiles per device
(14 query heads and 2 kv heads of 128 on tensor 2, pages of 16, table widths 24 … 96), small
rows and pools, bfloat16 and float32, on one device and on the engine's mesh (data 4 ×
tensor 2, inside `shard_map`). Its scratch is the padded q and the output only: no pool copy.

Skipped without the CUDA PJRT plugin (`jax-cuda12-plugin`, `jax-cuda12-pjrt` and
`nvidia-cuda-nvcc-cu12` for ptxas: `hybridjax.memory.gpu_targets`)."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from hybridjax.memory.gpu_targets import compile_only_devices
from hybridjax.rollout.decode_attention import decode_attention, decode_specs
from hybridjax.rollout.paged_kernel import paged_attention_kernel


def _has_cuda_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:  # no JAX plugin at all
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


HAS_PLUGIN = _has_cuda_plugin()
pytestmark = pytest.mark.skipif(not HAS_PLUGIN, reason="needs the CUDA PJRT plugin")

LAYERS, HEADS, KV, D, PAGE, PAGES = 2, 14, 2, 128, 16, 200


def _triton_calls(compiled) -> list[str]:
    return [line for line in compiled.as_text().splitlines() if "__gpu$xla.gpu.triton" in line]


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_kernel_compiles_for_the_gpu_at_every_width(target):
    device = compile_only_devices(target, 1)[0]
    sharding = SingleDeviceSharding(device)
    for dtype in (jnp.bfloat16, jnp.float32):
        for width in (24, 48, 72, 96):
            sds = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
            pool = sds((LAYERS, KV, PAGES, PAGE, D))
            args = (sds((4, 1, HEADS, D)), pool, pool, sds((4, width), jnp.int32),
                    sds((4, 1), jnp.int32), sds((), jnp.int32))  # fmt: skip
            with jax.set_mesh(Mesh([device], ("x",))):  # JAX 0.11+: the target of Triton
                compiled = jax.jit(paged_attention_kernel).lower(*args).compile()
            assert len(_triton_calls(compiled)) == 1, (target, dtype, width)
            pool_bytes = LAYERS * KV * PAGES * PAGE * D * jnp.dtype(dtype).itemsize
            temp = compiled.memory_analysis().temp_size_in_bytes
            assert temp < pool_bytes // 8, (target, dtype, width, temp)  # no pool copy


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_kernel_compiles_per_device_on_the_generation_mesh(target):
    """8 compile-only GPUs, data 4 × tensor 2: each device's kernel reads its own kv head."""
    mesh = Mesh(np.array(compile_only_devices(target, 8)).reshape(4, 2), ("data", "tensor"))
    rows, width = 16, 96
    q_spec, pool_spec, row_spec = decode_specs(mesh, rows, HEADS, KV, stacked=True)

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    pool = sds((LAYERS, KV, PAGES, PAGE, D), jnp.bfloat16, pool_spec)
    args = (sds((rows, 1, HEADS, D), jnp.bfloat16, q_spec), pool, pool,
            sds((rows, width), jnp.int32, row_spec), sds((rows, 1), jnp.int32, row_spec),
            sds((), jnp.int32, PartitionSpec()))  # fmt: skip
    fn = jax.jit(functools.partial(decode_attention, kernel="pallas", mesh=mesh))
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args[:5], layer=args[5]).compile()
    (call,) = _triton_calls(compiled)
    assert f"bf16[{LAYERS},1,{PAGES},{PAGE},{D}]" in call  # the device's stacked pool, whole
    assert " all-gather(" not in compiled.as_text()
