"""update_weights: training ⇄ generation layout, casts, bytes moved, donation, memory bound."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sharding_testing import TINY

from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    ACTOR_TRAIN_RULES,
    init_sharded,
    move_memory_bytes,
    state_shardings,
    update_weights,
)


@pytest.fixture(scope="module")
def gen_shardings(meshes, actor):
    return state_shardings(actor[1], meshes.generate, ACTOR_GENERATE_RULES)


@pytest.fixture(scope="module")
def gen_params(actor, gen_shardings):
    return update_weights(actor[1], gen_shardings)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_train_generate_train_round_trip_is_bit_identical(meshes, actor, gen_params):
    _, params = actor
    moved, _ = gen_params
    back, _ = update_weights(moved, state_shardings(params, meshes.train, ACTOR_TRAIN_RULES))
    for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert after.sharding == before.sharding
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_generation_layout_gives_the_training_logits(actor, gen_params):
    graphdef, params = actor
    ids_BxT = jax.random.randint(jax.random.key(1), (4, 12), 0, TINY.vocab_size)
    mask_BxT = jnp.ones((4, 12), bool).at[1, :5].set(False)  # one left-padded row
    forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))
    train_logits = forward(params, ids_BxT, mask_BxT)
    gen_logits = forward(gen_params[0], ids_BxT, mask_BxT)
    np.testing.assert_allclose(np.asarray(gen_logits), np.asarray(train_logits), atol=1e-6)


def test_bytes_moved_counts_every_replica(actor, gen_params):
    _, params = actor
    _, nbytes = gen_params
    # Generation mesh data=4 × tensor=2: a tensor-split leaf lives on 8 devices at 1/2 size
    # (4 copies), a replicated leaf (norm weights) at full size on all 8 devices.
    expected = 0
    for path, variable in nnx.to_flat_state(params):
        size = variable.get_value().nbytes
        expected += 8 * size if path[-1] == "weight" else 4 * size
    assert nbytes == expected
    d, f, v, h, kv, hd = 64, 128, 256, 4, 2, 16
    n_split = 2 * v * d + 3 * d * f + d * hd * (2 * h + 2 * kv) + hd * (h + 2 * kv)
    assert nbytes == 4 * 4 * n_split + 8 * 4 * 3 * d  # float32, one layer, 3 norms


def test_cast_to_bfloat16_for_decoding(actor, gen_shardings):
    _, params = actor
    moved, nbytes = update_weights(params, gen_shardings, dtype=jnp.bfloat16)
    for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(moved), strict=True):
        assert after.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before.astype(jnp.bfloat16)))
    assert nbytes * 2 == update_weights(params, gen_shardings)[1]


def test_donation_frees_the_source(actor, gen_shardings):
    _, params = actor
    copy = jax.tree.map(jnp.copy, params)
    moved, _ = update_weights(copy, gen_shardings, donate=True)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(copy))
    for want, got in zip(_leaves(params), _leaves(moved), strict=True):
        np.testing.assert_array_equal(got, want)


def test_peak_memory_is_source_plus_destination(actor, gen_shardings):
    # XLA's compiled memory analysis per leaf move: the per-device argument is the training
    # shard, the output the generation shard; scratch (a transpose when fsdp splits a minor
    # dimension) never exceeds the leaf's own generation shard. Peak = both copies + one leaf.
    _, params = actor
    gate = params["model"]["layers"][0]["mlp"]["gate_proj"].get_value()
    target = gen_shardings["model"]["layers"][0]["mlp"]["gate_proj"].get_value()
    stats = move_memory_bytes(gate, target)
    assert stats["argument"] == 64 * 128 * 4 // 8
    assert stats["output"] == 64 * 128 * 4 // 2
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(gen_shardings), strict=True):
        stats = move_memory_bytes(leaf, sharding)
        shard = np.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        assert stats["argument"] == shard
        assert stats["output"] == np.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        assert stats["temp"] <= stats["output"]
    assert move_memory_bytes(gate, target)["temp"] == 0  # gathering the major dimension


def test_mismatched_shardings_are_rejected(actor, gen_shardings):
    _, params = actor
    with pytest.raises(ValueError, match="do not match the parameter tree"):
        update_weights(params["model"], gen_shardings)


def test_stacked_layers_move_like_any_leaf(meshes, actor):
    """A scanned actor's stacked layer weights (leading `layers` axis, replicated) re-lay to the
    generation mesh and back bit for bit, and give the per-layer actor's logits there."""
    config = dataclasses.replace(TINY, scan_layers=True)
    graphdef, params = nnx.split(init_sharded(CausalLM, config, meshes.train, ACTOR_TRAIN_RULES))
    q = params["model"]["layers"]["self_attn"]["q_proj"].get_value()
    assert q.shape[0] == TINY.num_hidden_layers and q.sharding.spec[0] is None
    gen, _ = update_weights(params, state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES))
    back, _ = update_weights(gen, state_shardings(params, meshes.train, ACTOR_TRAIN_RULES))
    for before, after in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        assert after.sharding == before.sharding
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    ids_BxT = jax.random.randint(jax.random.key(1), (4, 12), 0, TINY.vocab_size)
    mask_BxT = jnp.ones((4, 12), bool).at[1, :5].set(False)
    scanned = jax.jit(lambda s: nnx.merge(graphdef, s)(ids_BxT, mask_BxT))(gen)
    loop = jax.jit(lambda s: nnx.merge(actor[0], s)(ids_BxT, mask_BxT))(actor[1])
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(loop), atol=1e-5)


def test_forward_returns_leaves_already_in_place_without_a_copy(meshes, actor, gen_params):
    # generation → generation: every leaf is where it goes; with `forward` nothing is written
    moved, _ = gen_params
    same = jax.tree.map(lambda x: x.sharding, moved)
    out, nbytes = update_weights(moved, same, forward=True, donate=True)
    assert nbytes == 0
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(out), strict=True):
        assert b is a and not a.is_deleted()  # shared, so never deleted by `donate`
    # a cast or another layout still moves (and copies) the leaf
    cast, _ = update_weights(moved, same, dtype=jnp.bfloat16, forward=True)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(cast))
    _, params = actor
    train = state_shardings(params, meshes.train, ACTOR_TRAIN_RULES)
    back, nbytes = update_weights(moved, train, forward=True)
    assert nbytes > 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    without, _ = update_weights(moved, same)  # the default copies: XLA never forwards
    pairs = zip(jax.tree.leaves(moved), jax.tree.leaves(without), strict=True)
    assert not any(b is a for a, b in pairs)
