"""The engine with a scanned model (`ModelConfig.scan_layers`): its KV pools are stacked, one
L×K×N×S×D array each (`paged_cache.stacked_layout`), allocated, sharded (layers whole, kv heads
over `tensor`, pages by replica over `data`), donated and released by `sleep`; its samples,
greedy and seeded, and their log-probs equal the unscanned engine's, on one device and on data
4 × tensor 2, whose compiled decode call all-gathers no pool.

The scanned model gets the unscanned one's weights (`scanned_copy`), whichever way the decoder
stores its layers: per layer, or stacked on a leading layer axis."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from flax import nnx
from jax.sharding import PartitionSpec
from rollout_testing import make_prompts

from hybridjax.models.decoder import CausalLM
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.sharding import MeshConfig, make_meshes

PARAMS = {
    "greedy": SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
    "seeded": SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=8, seed=4),
}
MESH_CONFIG = RolloutConfig(
    page_size=4, num_pages=8, max_num_seqs=8, prompt_length=16, response_length=8,
    decode_steps_per_call=4,
)  # fmt: skip


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _per_layer(names: tuple) -> tuple[tuple, tuple]:
    """(the path without its integer keys, those keys): a layer's leaf and its layer."""
    return tuple(n for n in names if not isinstance(n, int)), tuple(
        n for n in names if isinstance(n, int)
    )


def scanned_copy(model: CausalLM) -> CausalLM:
    """`model` with `scan_layers` on and the same weights: each leaf of the scanned model is
    the unscanned leaf at the same path, or the layers' leaves stacked on a new leading axis
    (a decoder that stores its layers stacked). Skips the test when the structures do not
    map onto each other that way."""
    config = dataclasses.replace(model.config, scan_layers=True)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    flat = {_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}
    layers: dict[tuple, list] = {}
    for names, x in sorted(flat.items(), key=lambda kv: _per_layer(kv[0])[1]):
        layers.setdefault(_per_layer(names)[0], []).append(x)

    def fill(path, like):
        names = _names(path)
        value = flat.get(names)
        if value is None and names in layers:
            value = jnp.stack(layers[names])
        if value is None or value.shape != like.shape:
            pytest.skip(f"no unscanned weight maps onto the scanned model's {names}")
        return value

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abstract))


@pytest.fixture(scope="module")
def scanned_engine(eos_model):
    return Engine(scanned_copy(eos_model), ENGINE_CONFIG)


@pytest.fixture(scope="module")
def scanned_sharded(eos_model):
    return Engine(scanned_copy(eos_model), MESH_CONFIG, mesh=_mesh())


def _mesh():
    return make_meshes(MeshConfig(generate=(4, 2))).generate


def _assert_same_samples(got_engine, want_engine, params):
    want = generate(want_engine, make_prompts(), params)
    got = generate(got_engine, make_prompts(), params)
    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.response_mask, want.response_mask)
    np.testing.assert_allclose(got.rollout_log_probs, want.rollout_log_probs, atol=1e-5, rtol=0)
    assert got.finish_reason == want.finish_reason


def test_scanned_copy_has_the_same_weights(eos_model):
    scanned = scanned_copy(eos_model)
    assert scanned.config.scan_layers and not eos_model.config.scan_layers
    ids = jnp.asarray([make_prompts()[1]])
    mask = jnp.ones(ids.shape, bool)
    np.testing.assert_allclose(scanned(ids, mask), eos_model(ids, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_scanned_engine_equals_unscanned(scanned_engine, engine, params):
    c = scanned_engine.model_config
    assert scanned_engine.stacked and not engine.stacked
    shape = (c.num_hidden_layers, c.num_key_value_heads, scanned_engine.num_pages)
    assert scanned_engine.k_pools.shape[:3] == shape
    _assert_same_samples(scanned_engine, engine, params)


def test_chunked_prefill_extends_stacked_pools(eos_model, engine):
    """5 prompt tokens per engine step: later chunks of a prompt are written and attend to
    the cached ones through `steps.extend` (several tokens per row) on stacked pools."""
    config = dataclasses.replace(ENGINE_CONFIG, max_num_batched_tokens=5)
    budgeted = Engine(scanned_copy(eos_model), config)
    _assert_same_samples(budgeted, engine, PARAMS["seeded"])
    assert any(name.startswith("extend") for name in budgeted.compile_counts)


def test_sleep_releases_stacked_pools_and_wake_up_generates_the_same(scanned_engine):
    params = PARAMS["seeded"]
    before = generate(scanned_engine, make_prompts(), params)
    pools = [scanned_engine.k_pools, scanned_engine.v_pools]
    assert all(isinstance(x, jax.Array) and x.ndim == 5 for x in pools)
    assert scanned_engine.sleep(1) == sum(x.nbytes for x in pools)
    assert all(x.is_deleted() for x in pools)
    assert not {id(x) for x in pools} & {id(x) for x in jax.live_arrays()}
    scanned_engine.wake_up()
    assert scanned_engine.k_pools.shape == pools[0].shape
    after = generate(scanned_engine, make_prompts(), params)
    np.testing.assert_array_equal(after.responses, before.responses)
    np.testing.assert_array_equal(after.rollout_log_probs, before.rollout_log_probs)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_sharded_scanned_engine_equals_single_device(scanned_sharded, engine, params):
    """8 pages per replica: replicas preempt (pages on demand) and copy pages, on stacked
    pools."""
    assert scanned_sharded.k_pools.sharding.spec == PartitionSpec(None, "tensor", "data")
    _assert_same_samples(scanned_sharded, engine, params)
    assert scanned_sharded.num_preemptions > 0
    assert scanned_sharded.num_free_pages == scanned_sharded.replicas * scanned_sharded.num_pages


def test_sharded_sleep_releases_every_shard(scanned_sharded):
    pools = [scanned_sharded.k_pools, scanned_sharded.v_pools]
    sharding = pools[0].sharding
    shard_bytes = sum(s.data.nbytes for x in pools for s in x.addressable_shards)
    # kv heads over `tensor`, pages over `data`: each device holds 1/8, nothing replicated
    assert {s.data.shape[1:3] for x in pools for s in x.addressable_shards} == {(1, 8)}
    assert shard_bytes == sum(x.nbytes for x in pools)
    assert scanned_sharded.sleep(1) == shard_bytes
    assert all(x.is_deleted() for x in pools)
    assert not {id(x) for x in pools} & {id(x) for x in jax.live_arrays()}
    scanned_sharded.wake_up()
    assert scanned_sharded.k_pools.sharding == sharding


def test_partitioned_scanned_decode_call_gathers_no_pool(scanned_sharded):
    """One decode call (4 steps, 8 rows) of the scanned engine compiled on data 4 × tensor 2:
    no all-gather or all-to-all (each replica its pages, each device its kv heads)."""
    engine = scanned_sharded
    batch = engine.slots.take(np.arange(8), 8, engine.config.pages_per_seq)
    lowered = engine.programs.decode_jit.lower(
        engine.state, engine.k_pools, engine.v_pools, engine.programs.upload(batch), np.int32(9),
        num_steps=4, use_filter=False,
    )  # fmt: skip
    hlo = lowered.compile().as_text()
    assert not re.search(r" (all-gather|all-to-all)(-start)?\(", hlo)
