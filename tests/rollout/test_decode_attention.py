"""Decode attention: the kernel choice, Pallas blocks that Triton accepts at every page-table
width, CUDA lowering of every kernel at every (rows bucket, width) a 512 + 1024 rollout compiles
with 7B shapes, and the partitioned HLO of a decode call on data 4 × tensor 2 (no all-gather of
a KV pool or of q)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from rollout_testing import make_model

from hybridjax.rollout import Engine, RolloutConfig
from hybridjax.rollout.decode_attention import (
    DECODE_KERNELS,
    decode_attention,
    decode_specs,
    paged_attention_jnp,
    paged_attention_pallas,
    pallas_blocks,
    select_decode_kernel,
)
from hybridjax.rollout.slots import decode_batch_size, table_widths
from hybridjax.sharding import MeshConfig, make_meshes

# Qwen2.5-7B attention: 28 query heads, 4 kv heads of 128, bfloat16; 16-token pages.
HEADS, KV_HEADS, HEAD_DIM, PAGE = 28, 4, 128, 16
ROLLOUT_7B = RolloutConfig(
    page_size=PAGE, max_num_seqs=256, prompt_length=512, response_length=1024
)
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _mesh():
    return make_meshes(MeshConfig(generate=(4, 2))).generate


def test_auto_picks_the_jnp_path_and_pallas_is_checked():
    assert select_decode_kernel("auto", None, "gpu") == "jnp"
    assert select_decode_kernel("auto", 4, "cpu") == "jnp"
    assert select_decode_kernel("pallas", None, "gpu") == "pallas"
    with pytest.raises(ValueError, match="sliding window"):
        select_decode_kernel("pallas", 4, "gpu")
    with pytest.raises(ValueError, match="needs a GPU"):
        select_decode_kernel("pallas", None, "cpu")
    with pytest.raises(ValueError, match="'flash'"):
        select_decode_kernel("flash", None, "gpu")


def test_pallas_blocks_by_hand():
    assert [pallas_blocks(w) for w in (24, 48, 72, 96)] == [
        (24, 3, 8), (48, 6, 8), (72, 9, 8), (96, 12, 8),
    ]  # fmt: skip
    assert pallas_blocks(3) == (4, 1, 4)
    assert pallas_blocks(300) == (320, 10, 8)  # partitions of 32 keep k_splits <= 16


def test_pallas_blocks_are_powers_of_two_at_every_width():
    for width in range(1, 1025):
        padded, k_splits, per_block = pallas_blocks(width)
        per_split = padded // k_splits
        assert padded == per_split * k_splits and 0 <= padded - width < per_split, width
        assert per_split & (per_split - 1) == 0 and per_block & (per_block - 1) == 0, width
        assert per_split % per_block == 0 and k_splits <= 16, width


def test_pallas_kernel_matches_jnp_in_interpret_mode():
    """Width 20 is padded to 3 partitions of 8 (`pallas_blocks`); scattered pages, mixed
    lengths."""
    width = 20
    rng = np.random.default_rng(0)
    b, h, kv, d, pages, page = 3, 4, 2, 16, 80, 4
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(kv, pages, page, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(kv, pages, page, d)), jnp.float32)
    table = jnp.asarray(rng.permutation(pages)[: b * width].reshape(b, width), jnp.int32)
    positions = jnp.array([[0], [width * page // 2], [width * page - 1]])
    expect = paged_attention_jnp(q, k, v, table, positions)
    got = paged_attention_pallas(q, k, v, table, positions, interpret=True)
    np.testing.assert_allclose(got, expect, atol=1e-5, rtol=0)


def _abstract_decode_args(mesh, rows: int, width: int, num_pages: int = 2048):
    q_spec, pool_spec, row_spec = decode_specs(mesh, rows, HEADS, KV_HEADS)

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    pool = sds((KV_HEADS, num_pages, PAGE, HEAD_DIM), jnp.bfloat16, pool_spec)
    return (
        sds((rows, 1, HEADS, HEAD_DIM), jnp.bfloat16, q_spec),
        pool,
        pool,
        sds((rows, width), jnp.int32, row_spec),
        sds((rows, 1), jnp.int32, row_spec),
    )


def test_every_kernel_lowers_for_cuda_at_every_shape_a_512_1024_rollout_compiles():
    """Abstract 7B shapes on the generation mesh (data 4 × tensor 2): each device's kernel sees
    its rows, 14 query heads and 2 kv heads. The old blocks failed at widths 48, 72, 96."""
    mesh = _mesh()
    data = mesh.shape["data"]
    n = ROLLOUT_7B.max_num_seqs
    rows_buckets = sorted({decode_batch_size(a, n, data) for a in range(1, n + 1)})
    widths = table_widths(ROLLOUT_7B.pages_per_seq)
    assert rows_buckets == [4, 8, 16, 32, 64, 128, 256] and widths == [24, 48, 72, 96]
    for kernel in DECODE_KERNELS:
        fn = jax.jit(functools.partial(decode_attention, kernel=kernel, mesh=mesh))
        for rows in rows_buckets:
            for width in widths:
                exported = export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(
                    *_abstract_decode_args(mesh, rows, width)
                )
                text = exported.mlir_module()
                assert "sdy.manual_computation" in text, (kernel, rows, width)
                if kernel == "pallas":
                    calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
                    assert len(calls) == 1, (rows, width)
                    # The kernel reads the device's own kv heads: 2 of 4.
                    assert "tensor<2x2048x16x128xbf16>" in text, (rows, width)


def _collectives(hlo: str) -> list[tuple[str, list[int]]]:
    """(op, result shape) of every all-gather / all-to-all in compiled HLO text."""
    found = []
    for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} (all-gather|all-to-all)\(", hlo):
        found.append((m.group(2), [int(x) for x in m.group(1).split(",") if x]))
    return found


def _group_size(replica_groups: str) -> int:
    """Devices per group of an HLO `replica_groups` ("[4,2]<=[8]" or "{{0,1},{2,3},...}");
    -1 for another form (a reduction named by mesh axes)."""
    iota = re.match(r"\[(\d+),(\d+)\]<=", replica_groups)
    listed = re.match(r"\{\{([\d,]*)\}", replica_groups)
    if iota:
        return int(iota.group(2))
    return len(listed.group(1).split(",")) if listed else -1


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_decode_attention_on_the_mesh_runs_per_device(kernel):
    """Inside `shard_map` the compiled call has no collective at all and equals the
    single-device jnp reference (Pallas in interpret mode on CPU)."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    b, h, kv, d, pages, page, width = 8, 4, 2, 16, 37, 4, 6
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(kv, pages, page, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(kv, pages, page, d)), jnp.float32)
    table = jnp.asarray(rng.integers(0, pages, size=(b, width)), jnp.int32)
    positions = jnp.asarray(rng.integers(0, width * page, size=(b, 1)), jnp.int32)
    specs = decode_specs(mesh, b, h, kv)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(q, specs[0]), put(k, specs[1]), put(v, specs[1]), put(table, specs[2]),
            put(positions, specs[2]))  # fmt: skip
    fn = jax.jit(functools.partial(decode_attention, kernel=kernel, mesh=mesh, interpret=True))
    hlo = fn.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    got = fn(*args)
    assert got.sharding.spec == specs[0]
    expect = paged_attention_jnp(q, k, v, table, positions)
    np.testing.assert_allclose(got, expect, atol=1e-5, rtol=0)


def test_partitioned_decode_call_gathers_no_kv_pool_and_no_q():
    """One engine decode call (4 steps, 8 rows) compiled on data 4 × tensor 2: no all-gather
    or all-to-all at all (no pool of 37 pages, no q, not even a step's new keys: each replica
    writes only its own pool), only the `tensor` all-reduces of the row-parallel matmuls."""
    config = RolloutConfig(
        page_size=4, num_pages=37, max_num_seqs=8, prompt_length=16, response_length=8,
        decode_steps_per_call=4, attention_impl="jnp",
    )  # fmt: skip
    engine = Engine(make_model(), config, mesh=_mesh())
    batch = engine.slots.take(np.arange(8), 8, config.pages_per_seq)
    lowered = engine._decode_jit.lower(
        engine.state, engine.k_pools, engine.v_pools, engine._upload(batch), np.int32(9),
        num_steps=4, use_filter=False,
    )  # fmt: skip
    hlo = lowered.compile().as_text()
    assert _collectives(hlo) == []
    assert " all-gather(" not in hlo and " all-to-all(" not in hlo
    groups = re.findall(r" all-reduce\(.*?replica_groups=(\S+)", hlo)
    assert groups and {_group_size(g) for g in groups} == {2}, groups  # over `tensor` only
