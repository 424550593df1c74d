"""The engine's sleep mode (`Engine.sleep` / `wake_up`, vLLM's names): the KV page pool and
the engine's own weights are deleted, gone from `jax.live_arrays()`, and a woken engine
generates exactly what it did before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ENGINE_CONFIG
from flax import nnx
from jax.sharding import Mesh
from rollout_testing import make_prompts

from hybridjax.metrics import compiled_programs
from hybridjax.rollout import Engine, SamplingParams, generate

PARAMS = SamplingParams(n=2, temperature=0.7, max_tokens=6, seed=3)


def _live_ids() -> set[int]:
    return {id(x) for x in jax.live_arrays()}


def _own_copy(model):
    """The model on fresh buffers (the engine's weights are then its own to delete, as the
    trainer's generation copy is; the shared test model must survive)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def test_sleep_deletes_pool_and_weights_and_wake_up_generates_the_same(eos_model):
    engine = Engine(_own_copy(eos_model), ENGINE_CONFIG)
    before = generate(engine, make_prompts(), PARAMS)
    pools, weights = (engine.k_pools, engine.v_pools), engine.state
    held = jax.tree.leaves((pools, weights))
    nbytes = sum(x.nbytes for x in held)  # one device: the shards are the arrays
    assert engine.sleep(2) == nbytes
    assert engine.asleep and all(x.is_deleted() for x in held)
    assert not {id(x) for x in held} & _live_ids()
    with pytest.raises(RuntimeError, match="update_weights"):
        generate(engine, make_prompts(), PARAMS)
    engine.update_weights(nnx.state(_own_copy(eos_model)))  # what `reshard` does
    assert engine.asleep  # the pool waits for the next prefill
    after = generate(engine, make_prompts(), PARAMS)
    assert not engine.asleep
    assert (after.responses == before.responses).all()
    assert (after.rollout_log_probs == before.rollout_log_probs).all()


def test_waking_after_sleep_compiles_nothing(eos_model):
    """The pool comes back through the program the engine compiled once: a sharded pool (two
    replicas), whose zeros are laid out by `out_shardings`, as the trainer's."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    engine = Engine(eos_model, ENGINE_CONFIG, mesh=mesh)
    first = generate(engine, make_prompts(), PARAMS)
    for _ in range(2):
        engine.sleep(1)
        seen = len(compiled_programs())
        again = generate(engine, make_prompts(), PARAMS)
        assert compiled_programs()[seen:] == []
        assert (again.responses == first.responses).all()


def test_level_one_keeps_the_weights(eos_model):
    engine = Engine(_own_copy(eos_model), ENGINE_CONFIG)
    pools = jax.tree.leaves((engine.k_pools, engine.v_pools))
    engine.sleep(1)
    assert all(x.is_deleted() for x in pools)
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.state))
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)
    engine.wake_up()
    assert engine.k_pools is not None
