"""Decode attention: the kernel choice by platform, both kernels (the Pallas one in interpret
mode) against the gather reference at every rows bucket, page-table width and GQA ratio the
engine compiles, CUDA lowering of both at every (rows bucket, width) a 512 + 1024 rollout
compiles with 7B shapes, the partitioned HLO of a decode call on data 4 × tensor 2 (no
all-gather of a KV pool or of q), and the engine's decode loop by blocks of pages."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from rollout_testing import make_model, make_prompts, trainer_log_probs

from hybridjax.platforms import platform_of
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate, steps
from hybridjax.rollout import decode_attention as decode_attention_module
from hybridjax.rollout.decode_attention import (
    DECODE_KERNELS,
    decode_attention,
    decode_specs,
    paged_attention_blocked,
    paged_attention_jnp,
    select_decode_kernel,
)
from hybridjax.rollout.paged_kernel import kernel_blocks, paged_attention_kernel
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


def test_auto_follows_the_mesh_platform_and_pallas_is_checked():
    assert select_decode_kernel("auto", None, "gpu") == "pallas"
    assert select_decode_kernel("auto", None, "cpu") == "jnp"
    assert select_decode_kernel("auto", None, "tpu") == "jnp"
    assert select_decode_kernel("pallas", 4, "gpu") == "pallas"  # a sliding window too
    with pytest.raises(ValueError, match="needs a GPU"):
        select_decode_kernel("pallas", None, "cpu")
    with pytest.raises(ValueError, match="'flash'"):
        select_decode_kernel("flash", None, "gpu")
    assert platform_of(_mesh()) == "cpu" and platform_of(None) == jax.default_backend()
    # the kernel's tiles: a power-of-two head dim and page size, else "auto" falls back
    assert select_decode_kernel("auto", None, "gpu", head_dim=96) == "jnp"
    assert select_decode_kernel("auto", None, "gpu", page_size=12) == "jnp"
    with pytest.raises(ValueError, match="power-of-two head_dim and page_size, got 96"):
        select_decode_kernel("pallas", None, "gpu", head_dim=96)


def test_kernel_blocks_by_hand():
    # 7B's widths with 16-token pages: blocks of 8 pages (128 keys), no padding
    assert [kernel_blocks(w, 16) for w in (24, 48, 72, 96)] == [(w, 8) for w in (24, 48, 72, 96)]
    assert kernel_blocks(20, 16) == (24, 8)
    assert kernel_blocks(3, 16) == (4, 4)  # a narrow table: a block of its width
    assert kernel_blocks(3, 4) == (4, 4)  # at least 16 keys: a dot tile
    assert kernel_blocks(1, 4) == (4, 4)
    with pytest.raises(ValueError, match=">= 1"):
        kernel_blocks(0, 16)


def _case(rng, rows, width, heads, kv, dtype, page=PAGE, d=16, layers=2, pages=None):
    """Random q, stacked pools, a page table of scattered pages (some entries out of range:
    clamped where unused) and positions from 0 to the table's last key."""
    pages = pages or 2 * width + 3
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, d)), dtype)
    k = jnp.asarray(rng.normal(size=(layers, kv, pages, page, d)), dtype)
    v = jnp.asarray(rng.normal(size=(layers, kv, pages, page, d)), dtype)
    table = rng.integers(0, pages, size=(rows, width))
    positions = rng.integers(0, width * page, size=(rows, 1))
    positions[0], positions[-1] = 0, width * page - 1
    for r in range(rows):  # entries past a row's last page may hold anything
        table[r, positions[r, 0] // page + 1 :] = 10**6
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(positions, jnp.int32)


# Every rows bucket per replica (1 … 64: 7B's 4 … 256 rows over data 4), page-table width (7B's
# 24, 48, 72, 96 pages of 16) and GQA ratio of the models we ship (7: Qwen2.5, on tensor 2 or
# not; 4: Llama 3 8B; 1, 2, 8) at least once each, in float32 (within 1e-5) and bfloat16
# (within 2e-2, its rounding of probabilities); small head dim and pools.
F32, BF16 = (jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)
KERNEL_CASES = [  # (rows, width, heads, kv heads, (dtype, atol))
    (1, 24, 14, 2, F32), (2, 48, 7, 1, BF16), (4, 72, 4, 1, F32), (8, 96, 8, 2, BF16),
    (16, 24, 2, 2, F32), (32, 48, 4, 2, BF16), (64, 72, 8, 1, F32), (4, 96, 14, 2, BF16),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "width", "heads", "kv", "dtype"), KERNEL_CASES)
def test_kernel_matches_the_gather_reference_in_interpret_mode(rows, width, heads, kv, dtype):
    """Both kernels (Pallas in interpret mode) at a traced layer of stacked pools."""
    (dtype, atol), rng = dtype, np.random.default_rng(rows)
    q, k, v, table, positions = _case(rng, rows, width, heads, kv, dtype)
    layer = jnp.int32(1)
    expect = paged_attention_jnp(q, k, v, table, positions, layer=layer).astype(jnp.float32)
    for kernel in DECODE_KERNELS:
        fn = jax.jit(functools.partial(decode_attention, kernel=kernel, interpret=True))
        got = fn(q, k, v, table, positions, layer=layer)
        assert got.dtype == dtype and got.shape == q.shape
        np.testing.assert_allclose(got.astype(jnp.float32), expect, atol=atol, rtol=0)


@pytest.mark.parametrize("kernel", DECODE_KERNELS)
def test_kernel_with_a_sliding_window_and_per_layer_pools(kernel):
    """A window of 5 keys over 4-token pages (blocks start mid-window), one layer's pool."""
    rng = np.random.default_rng(1)
    q, k, v, table, positions = _case(rng, 5, 6, 4, 2, jnp.float32, page=4, layers=1)
    k, v = k[0], v[0]
    expect = paged_attention_jnp(q, k, v, table, positions, sliding_window=5)
    got = decode_attention(
        q, k, v, table, positions, kernel=kernel, sliding_window=5, interpret=True
    )
    np.testing.assert_allclose(got, expect, atol=1e-5, rtol=0)


def test_jnp_kernel_takes_several_queries_per_row():
    """`extend` appends T tokens per row through the jnp kernel: blocks of 8 keys."""
    rng = np.random.default_rng(2)
    q, k, v, table, _ = _case(rng, 3, 6, 4, 2, jnp.float32, page=4, layers=1)
    q = jnp.concatenate([q, q[:, :, ::-1]], axis=1)  # T = 2
    positions = jnp.array([[0, 1], [9, 10], [22, 23]], jnp.int32)
    table = jnp.minimum(table, 14)
    expect = paged_attention_jnp(q, k[0], v[0], table, positions)
    got = paged_attention_blocked(q, k[0], v[0], table, positions, block_keys=8)
    np.testing.assert_allclose(got, expect, atol=1e-5, rtol=0)


def test_the_tests_can_fail():
    """A kernel that attends one key too many is caught by the comparison above."""
    rng = np.random.default_rng(3)
    q, k, v, table, positions = _case(rng, 4, 6, 4, 2, jnp.float32, page=4, layers=1)
    table = jnp.minimum(table, k.shape[2] - 1)
    expect = paged_attention_jnp(q, k[0], v[0], table, positions)
    got = paged_attention_kernel(q, k[0], v[0], table, positions + 1, interpret=True)
    assert np.abs(np.asarray(got) - np.asarray(expect)).max() > 1e-3


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
    lowered = engine.programs.decode_jit.lower(
        engine.state, engine.k_pools, engine.v_pools, engine.programs.upload(batch), np.int32(9),
        num_steps=4, use_filter=False,
    )  # fmt: skip
    hlo = lowered.compile().as_text()
    assert _collectives(hlo) == []
    assert " all-gather(" not in hlo and " all-to-all(" not in hlo
    groups = re.findall(r" all-reduce\(.*?replica_groups=(\S+)", hlo)
    assert groups and {_group_size(g) for g in groups} == {2}, groups  # over `tensor` only


def test_engine_decodes_by_blocks_beyond_the_copy_bound(eos_model, monkeypatch):
    """With the per-call copy's bound at 0 the decode loop reads one block of pages at a time
    (`paged_attention_blocked` is traced): log-probs still equal the trainer's."""
    traced = []
    blocked = decode_attention_module.paged_attention_blocked
    monkeypatch.setattr(steps, "MAX_GATHERED_BYTES", 0)
    monkeypatch.setattr(
        decode_attention_module,
        "paged_attention_blocked",
        lambda *args, **kw: traced.append(1) or blocked(*args, **kw),
    )
    config = RolloutConfig(page_size=4, max_num_seqs=4, prompt_length=16, response_length=8)
    engine = Engine(eos_model, config)
    prompts = make_prompts()[:4]
    out = generate(engine, prompts, SamplingParams(temperature=0.7, max_tokens=8, seed=5))
    assert traced
    for row, mask in enumerate(out.response_mask):
        resp = out.responses[row][mask.astype(bool)].tolist()
        expect = trainer_log_probs(eos_model, prompts[row], resp, 0.7)
        np.testing.assert_allclose(out.rollout_log_probs[row, : len(resp)], expect, atol=1e-5)
