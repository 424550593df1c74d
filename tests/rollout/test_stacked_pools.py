"""Stacked KV pools (one L×K×N×S×D array each, `paged_cache.stacked_layout`) indexed by a
traced layer inside a `lax.scan` over the layers, as a scanned decoder calls
`PagedKVCache.attend`: the same outputs, pages and gathered copies as the per-layer tuple
layout indexed by Python ints (prefill, decode with and without the gathered copy), on one
device and on the generation mesh (data 4 × tensor 2); no step copies a layer's pool on either
path; the partitioned decode step all-gathers no pool; the step lowers for CUDA with
either kernel.

The layers here are a toy attention block (projections, `attend`, output projection, a
residual), so the tests do not depend on how the decoder stores its layers."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec
from rollout_testing import TINY

from hybridjax.rollout.decode_attention import decode_attention, paged_attention_jnp
from hybridjax.rollout.paged_cache import (
    PagedKVCache,
    copy_pages,
    layer_of,
    pool_spec,
    stacked_layout,
)
from hybridjax.rollout.replicas import ROWS_SPEC, per_replica
from hybridjax.sharding import MeshConfig, make_meshes

CONFIG = dataclasses.replace(TINY, num_hidden_layers=3)  # 4 heads, 2 kv heads of 8
STACKED = dataclasses.replace(CONFIG, scan_layers=True)
LAYERS, HEADS, KV, HEAD_DIM = 3, 4, 2, 8
MODEL_DIM, PAGE, PAGES = 16, 4, 24
LENGTHS = (5, 9, 2, 7)  # four rows: data 4 splits them
STEPS = 3
EXTEND = 3  # tokens appended per row at once (`steps.extend`: decode mode, T > 1)
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def _mesh():
    return make_meshes(MeshConfig(generate=(4, 2))).generate


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = dict(
        q=(LAYERS, MODEL_DIM, HEADS, HEAD_DIM),
        k=(LAYERS, MODEL_DIM, KV, HEAD_DIM),
        v=(LAYERS, MODEL_DIM, KV, HEAD_DIM),
        o=(LAYERS, HEADS, HEAD_DIM, MODEL_DIM),
    )
    return {n: (0.15 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}


def _layer(w, h_BxTxM, positions_BxT, mask_BxT, cache: PagedKVCache, layer):
    """One toy attention block: the new keys/values through `cache.attend(layer, ...)`."""
    q = jnp.einsum("btm,mhd->bthd", h_BxTxM, w["q"])
    k = jnp.einsum("btm,mkd->btkd", h_BxTxM, w["k"])
    v = jnp.einsum("btm,mkd->btkd", h_BxTxM, w["v"])
    out, cache = cache.attend(layer, q, k, v, positions_BxT, mask_BxT)
    return h_BxTxM + jnp.einsum("bthd,hdm->btm", out, w["o"]), cache


def scanned(weights, h, positions, mask, cache):
    """The layers as one `lax.scan`, the cache in the carry, the layer index traced."""

    def body(carry, xs):
        (h, cache), (w, layer) = carry, xs
        return _layer(w, h, positions, mask, cache, layer), None

    (h, cache), _ = jax.lax.scan(body, (h, cache), (weights, jnp.arange(LAYERS)))
    return h, cache


def looped(weights, h, positions, mask, cache):
    """The layers as a Python loop, the layer index a Python int (an unscanned decoder)."""
    for i in range(LAYERS):
        h, cache = _layer(jax.tree.map(lambda x: x[i], weights), h, positions, mask, cache, i)
    return h, cache


def _inputs(seed: int = 1):
    """Prefill hidden states B×T×M with mask and positions; an extension by EXTEND tokens per
    row on top of the cached ones (row 1 only one of them, as `steps.extend` pads rows); then
    STEPS decode steps (row 2 inactive at the last one); a page table of scattered pages."""
    rng = np.random.default_rng(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    h = rng.standard_normal((b, t, MODEL_DIM)).astype(np.float32)
    mask = np.arange(t)[None] < np.array(LENGTHS)[:, None]
    positions = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
    ext_mask = np.ones((b, EXTEND), bool)
    ext_mask[1, 1:] = False
    ext_positions = (np.array(LENGTHS)[:, None] + np.arange(EXTEND)).astype(np.int32)
    ext = (rng.standard_normal((b, EXTEND, MODEL_DIM)).astype(np.float32), ext_positions, ext_mask)
    steps = []
    for j in range(STEPS):
        active = np.ones((b, 1), bool)
        active[2] = j < STEPS - 1
        pos = (np.array(LENGTHS) + EXTEND + j).astype(np.int32)[:, None]
        pos[1] -= EXTEND - 1  # row 1 extended by one token
        steps.append((rng.standard_normal((b, 1, MODEL_DIM)).astype(np.float32), pos, active))
    width = -(-(t + EXTEND + STEPS) // PAGE)
    table = rng.permutation(PAGES)[: b * width].reshape(b, width).astype(np.int32)
    return (h, positions, mask), ext, steps, table


def _run(forward, config, *, gathered: bool, mesh=None):
    """Prefill, an extension, then STEPS decode steps (with or without the gathered copy) of
    `forward` on pools of `config`'s layout. Returns (the outputs of every call, the final
    cache)."""
    prefill, ext, steps, table = _inputs()
    k, v = PagedKVCache.create_pool(config, PAGES, PAGE)
    weights = _weights()
    if mesh is not None:  # kv heads over `tensor`, rows over `data`
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        pools = pool_spec(stacked_layout(config), "tensor")
        k, v = put(k, pools), put(v, pools)
        table = put(table, PartitionSpec("data"))
        prefill, ext = (tuple(put(x, PartitionSpec("data")) for x in xs) for xs in (prefill, ext))
        steps = [tuple(put(x, PartitionSpec("data")) for x in s) for s in steps]
    step = jax.jit(forward)
    cache = PagedKVCache(k, v, jnp.asarray(table), "prefill")
    out, cache = step(weights, *prefill, cache)
    cache = dataclasses.replace(cache, mode="decode", mesh=mesh)
    extended, cache = step(weights, *ext, cache)  # several tokens per row
    outs = [out, extended]
    if gathered:
        cache = cache.gathered()
    for s in steps:
        out, cache = step(weights, *s, cache)
        outs.append(out)
    return outs, cache


def _stack(pools):
    return pools if not isinstance(pools, tuple) else jnp.stack(pools)


def _assert_same(got, want):
    (got_outs, got_cache), (want_outs, want_cache) = got, want
    for g, w in zip(got_outs, want_outs, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    for name in ("k", "v", "k_seq", "v_seq"):
        g, w = getattr(got_cache, name), getattr(want_cache, name)
        assert (g is None) == (w is None), name
        if g is not None:
            np.testing.assert_allclose(_stack(g), _stack(w), atol=1e-5, rtol=0, err_msg=name)


def test_create_pool_stacks_the_layers_of_a_scanned_model():
    k, v = PagedKVCache.create_pool(STACKED, PAGES, PAGE)
    assert k.shape == v.shape == (LAYERS, KV, PAGES, PAGE, HEAD_DIM)
    k, v = PagedKVCache.create_pool(CONFIG, PAGES, PAGE)
    assert isinstance(k, tuple) and len(k) == LAYERS and k[0].shape == (KV, PAGES, PAGE, 8)
    # a page's bytes do not depend on the layout
    assert PagedKVCache.page_bytes(STACKED, PAGE) == PagedKVCache.page_bytes(CONFIG, PAGE)


@pytest.mark.parametrize("gathered", [False, True])
def test_scanned_stacked_pools_equal_the_per_layer_loop(gathered):
    want = _run(looped, CONFIG, gathered=gathered)
    _assert_same(_run(scanned, STACKED, gathered=gathered), want)
    # the stacked layout with Python-int layers (a decoder that loops) as well
    _assert_same(_run(looped, STACKED, gathered=gathered), want)


@pytest.mark.parametrize("gathered", [False, True])
def test_scanned_stacked_pools_on_the_mesh_equal_one_device(gathered):
    mesh = _mesh()
    got_outs, got_cache = _run(scanned, STACKED, gathered=gathered, mesh=mesh)
    assert got_cache.k.sharding.spec == PartitionSpec(None, "tensor")
    _assert_same((got_outs, got_cache), _run(looped, CONFIG, gathered=gathered))


def test_per_layer_pools_refuse_a_traced_layer():
    k, v = PagedKVCache.create_pool(CONFIG, PAGES, PAGE)
    (h, positions, mask), _, _, table = _inputs()
    cache = PagedKVCache(k, v, jnp.asarray(table), "prefill")
    with pytest.raises(TypeError, match="stacked pools"):
        jax.eval_shape(scanned, _weights(), h, positions, mask, cache)
    assert layer_of(k, 1)[1] is None and layer_of(_stack(k), 1)[1] == 1


def _dynamic_slices_of(jaxpr, shape) -> int:
    """Dynamic slices (and gathers of whole layers) of an operand of `shape`, nested jaxprs
    included."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dynamic_slice" and eqn.invars[0].aval.shape == shape:
            count += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _dynamic_slices_of(inner, shape)
    return count


def _pallas_operands(jaxpr) -> list[tuple[int, ...]]:
    """Operand shapes of every `pallas_call` in `jaxpr`, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found += [tuple(v.aval.shape) for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _pallas_operands(inner)
    return found


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_no_kernel_copies_a_layer_of_a_stacked_pool(mode):
    """Writes scatter into the stacked pool, the jnp decode reads gather at (layer, page) and
    the Pallas kernel takes the whole stacked pool with the layer: no dynamic slice of the
    pool on either path (the check counts them: an earlier Pallas path sliced one per pool)."""
    k, v = PagedKVCache.create_pool(STACKED, PAGES, PAGE)
    (h, positions, mask), _, steps, table = _inputs()
    cache = PagedKVCache(k, v, jnp.asarray(table), mode)
    args = (h, positions, mask) if mode == "prefill" else steps[0]
    jaxpr = jax.make_jaxpr(scanned)(_weights(), *args, cache).jaxpr
    assert _dynamic_slices_of(jaxpr, k.shape) == 0
    if mode == "decode":
        pallas = dataclasses.replace(cache, impl="pallas")  # traced only, never run
        jaxpr = jax.make_jaxpr(scanned)(_weights(), *args, pallas).jaxpr
        assert _dynamic_slices_of(jaxpr, k.shape) == 0
        assert _pallas_operands(jaxpr).count(k.shape) == 2  # k and v pools, whole
        sliced = jax.make_jaxpr(lambda p, i: jax.lax.dynamic_index_in_dim(p, i, 0))(k, 1)
        assert _dynamic_slices_of(sliced.jaxpr, k.shape) == 1  # what the check would see


def _pool_copies(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Instructions of compiled HLO text that copy or slice an f32 array of `shape`."""
    dims = ",".join(map(str, shape))
    pattern = rf"= f32\[{dims}\]\{{[^}}]*\}} (copy|copy-start|dynamic-slice|slice)\("
    return [line.strip() for line in hlo.splitlines() if re.search(pattern, line)]


@pytest.mark.parametrize("gathered", [False, True])
def test_donated_scanned_decode_step_writes_the_pools_in_place(gathered):
    """One device, pools donated: the scatters write into the stacked pools carried by the
    scan's loop; no instruction copies or slices a whole pool (without donation XLA copies
    each pool once, which this check sees)."""
    k, v = PagedKVCache.create_pool(STACKED, PAGES, PAGE)
    _, _, steps, table = _inputs()

    def step(weights, h, positions, mask, k, v, table):
        cache = PagedKVCache(k, v, table, "decode")
        cache = cache.gathered() if gathered else cache
        out, cache = scanned(weights, h, positions, mask, cache)
        return out, cache.k, cache.v

    args = (_weights(), *steps[0], k, v, jnp.asarray(table))
    donated = jax.jit(step, donate_argnums=(4, 5)).lower(*args).compile().as_text()
    assert _pool_copies(donated, k.shape) == []
    kept = jax.jit(step).lower(*args).compile().as_text()
    assert _pool_copies(kept, k.shape)  # the check sees the copies XLA makes then


def test_pallas_kernel_reads_the_traced_layer_of_a_stacked_pool():
    """Interpret mode on CPU: the kernel at each traced layer equals the jnp path on that
    layer's own pool."""
    rng = np.random.default_rng(0)
    b, width = 3, 4
    q = jnp.asarray(rng.standard_normal((LAYERS, b, 1, HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((LAYERS, KV, PAGES, PAGE, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((LAYERS, KV, PAGES, PAGE, HEAD_DIM)), jnp.float32)
    table = jnp.asarray(rng.permutation(PAGES)[: b * width].reshape(b, width), jnp.int32)
    positions = jnp.array([[0], [7], [width * PAGE - 1]], jnp.int32)

    def run(kernel):
        def body(_, xs):
            q_l, layer = xs
            out = decode_attention(
                q_l, k, v, table, positions, kernel=kernel, interpret=True, layer=layer
            )
            return None, out

        return jax.lax.scan(body, None, (q, jnp.arange(LAYERS)))[1]

    expect = jnp.stack(
        [paged_attention_jnp(q[i], k[i], v[i], table, positions) for i in range(LAYERS)]
    )
    np.testing.assert_allclose(run("jnp"), expect, atol=1e-5, rtol=0)
    np.testing.assert_allclose(run("pallas"), expect, atol=1e-5, rtol=0)


def test_copy_pages_on_stacked_pools_equals_per_layer():
    rng = np.random.default_rng(0)
    pools = tuple(jnp.asarray(rng.standard_normal((KV, 6, PAGE, 2)), jnp.float32) for _ in "ab")
    src, dst = jnp.array([1, 0, 2]), jnp.array([3, 6, 5])  # 6: out of bounds, skipped
    want_k, want_v = copy_pages(pools, pools[::-1], src, dst)
    got_k, got_v = copy_pages(jnp.stack(pools), jnp.stack(pools[::-1]), src, dst)
    np.testing.assert_array_equal(got_k, jnp.stack(want_k))
    np.testing.assert_array_equal(got_v, jnp.stack(want_v))
    np.testing.assert_array_equal(got_k[:, :, 3], jnp.stack(pools)[:, :, 1])


# ------------------------------------------------------------------- one replica per `data`


def _replica_step(impl: str, gathered: bool, mesh):
    """One scanned decode step per replica as the engine runs it (`per_replica`, manual over
    `data`): each replica's rows and its own pages (local page numbers)."""

    def step(weights, h, positions, mask, k, v, table):
        cache = PagedKVCache(k, v, table, "decode", impl, mesh=mesh)
        cache = cache.gathered() if gathered else cache
        out, cache = scanned(weights, h, positions, mask, cache)
        return out, cache.k, cache.v

    rows, whole, pools = ROWS_SPEC, PartitionSpec(), pool_spec(True, None, "data")
    in_specs = (whole, rows, rows, rows, pools, pools, rows)
    return per_replica(step, mesh, in_specs, (rows, pools, pools))


def _abstract_step_args(mesh, rows: int = 8, width: int = 3, dtype=jnp.float32):
    """Abstract arguments of `_replica_step`: 6 pages per replica, pools sharded as the
    engine's (`Programs.pool_spec`)."""

    def sds(shape, spec, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    data = mesh.shape["data"]
    pool = sds((LAYERS, KV, 6 * data, PAGE, HEAD_DIM), pool_spec(True, "tensor", "data"))
    weights = {n: sds(x.shape, PartitionSpec()) for n, x in _weights().items()}
    rows_spec = PartitionSpec("data")
    return (
        weights,
        sds((rows, 1, MODEL_DIM), rows_spec),
        sds((rows, 1), rows_spec, jnp.int32),
        sds((rows, 1), rows_spec, jnp.bool_),
        pool,
        pool,
        sds((rows, width), rows_spec, jnp.int32),
    )


@pytest.mark.parametrize("gathered", [False, True])
def test_partitioned_scanned_decode_step_gathers_no_pool(gathered):
    """Compiled on data 4 × tensor 2: no all-gather or all-to-all at all (each replica
    writes and reads its own pages, each device its kv heads)."""
    mesh = _mesh()
    fn = jax.jit(_replica_step("jnp", gathered, mesh), donate_argnums=(4, 5))
    hlo = fn.lower(*_abstract_step_args(mesh)).compile().as_text()
    assert not re.search(r"all-gather|all-to-all", hlo), re.findall(r".*all-gather.*", hlo)[:3]


@pytest.mark.parametrize(("impl", "gathered"), [("jnp", False), ("jnp", True), ("pallas", False)])
def test_scanned_decode_step_lowers_for_cuda(impl, gathered):
    """bfloat16 pools on data 4 × tensor 2: one layer body in the module (one Triton call for
    Pallas, not one per layer), the kernel inside `shard_map`."""
    mesh = _mesh()
    fn = jax.jit(_replica_step(impl, gathered, mesh), donate_argnums=(4, 5))
    args = _abstract_step_args(mesh, dtype=jnp.bfloat16)
    exported = export.export(fn, platforms=("cuda",), disabled_checks=[TRITON])(*args)
    text = exported.mlir_module()
    assert "sdy.manual_computation" in text
    assert "stablehlo.while" in text  # the scan over layers
    calls = [line for line in text.splitlines() if "xla.gpu.triton" in line]
    assert len(calls) == (1 if impl == "pallas" else 0)
    if impl == "pallas":  # the kernel reads the stacked pool of its device's kv heads, 1 of 2
        pool = f"tensor<{LAYERS}x1x6x{PAGE}x{HEAD_DIM}xbf16>"
        assert pool in calls[0], calls[0][:400]
        assert f"tensor<1x6x{PAGE}x{HEAD_DIM}xbf16>" not in text  # no layer sliced
