"""Rule tables → partition specs, and models initialised straight into their sharding."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharding_testing import TINY

from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    ACTOR_TRAIN_RULES,
    CRITIC_RULES,
    init_sharded,
    logical_to_spec,
    role_rules,
    sharding_fn,
    state_shardings,
)

# Expected specs, written out by hand from the issue (MLP over fsdp and tensor for training,
# tensor only for generation), keyed by the last path element. fsdp takes the major-most
# dimension it divides; 4 heads / 2 kv-heads do not split over tensor 2 × fsdp 4 = 8.
TRAIN_SPECS = {
    "embed_tokens": P(("tensor", "fsdp"), None),
    "lm_head": P("fsdp", "tensor"),
    "q_proj": P("fsdp", "tensor", None),
    "k_proj": P("fsdp", "tensor", None),
    "v_proj": P("fsdp", "tensor", None),
    "o_proj": P("tensor", None, "fsdp"),
    "q_bias": P("tensor", None),
    "k_bias": P("tensor", None),
    "v_bias": P("tensor", None),
    "gate_proj": P("fsdp", "tensor"),
    "up_proj": P("fsdp", "tensor"),
    "down_proj": P(("tensor", "fsdp"), None),
    "weight": P(None),
}
GENERATE_SPECS = {
    "embed_tokens": P("tensor", None),
    "lm_head": P(None, "tensor"),
    "q_proj": P(None, "tensor", None),
    "k_proj": P(None, "tensor", None),
    "v_proj": P(None, "tensor", None),
    "o_proj": P("tensor", None, None),
    "q_bias": P("tensor", None),
    "k_bias": P("tensor", None),
    "v_bias": P("tensor", None),
    "gate_proj": P(None, "tensor"),
    "up_proj": P(None, "tensor"),
    "down_proj": P("tensor", None),
    "weight": P(None),
}


def test_mlp_spec_by_hand(meshes):
    spec = logical_to_spec(("embed", "mlp"), (64, 128), meshes.train, ACTOR_TRAIN_RULES)
    assert spec == P("fsdp", "tensor")
    spec = logical_to_spec(("embed", "mlp"), (64, 128), meshes.generate, ACTOR_GENERATE_RULES)
    assert spec == P(None, "tensor")
    spec = logical_to_spec(("mlp", "embed"), (128, 64), meshes.train, ACTOR_TRAIN_RULES)
    assert spec == P(("tensor", "fsdp"), None)
    spec = logical_to_spec(("batch", "length"), (8, 16), meshes.train, ACTOR_TRAIN_RULES)
    assert spec == P(("data", "expert", "fsdp"), None)


def test_indivisible_dims_fall_back_and_axes_are_used_once(meshes):
    # 3 kv-heads over tensor=2: replicated. batch 2 over (data=1, expert=1, fsdp=4): data and
    # expert only.
    assert logical_to_spec(("kv_heads",), (3,), meshes.train, ACTOR_TRAIN_RULES) == P(None)
    spec = logical_to_spec(("batch",), (2,), meshes.train, ACTOR_TRAIN_RULES)
    assert spec == P(("data", "expert"))
    rules = (("a", "tensor"), ("b", "tensor"))
    assert logical_to_spec(("a", "b"), (4, 4), meshes.train, rules) == P("tensor", None)


def test_rule_errors_name_the_problem(meshes):
    with pytest.raises(ValueError, match="no rule for logical axis 'experts'"):
        logical_to_spec(("experts",), (4,), meshes.train, ACTOR_TRAIN_RULES)
    with pytest.raises(ValueError, match="not in"):
        logical_to_spec(("embed",), (64,), meshes.generate, ACTOR_TRAIN_RULES)  # no fsdp axis
    with pytest.raises(ValueError, match="do not match shape"):
        logical_to_spec(("embed",), (64, 2), meshes.train, ACTOR_TRAIN_RULES)
    with pytest.raises(ValueError, match="'actor', 'critic', 'ref', 'reward', 'rollout'"):
        role_rules("learner")


def _check_specs(state, expected, mesh):
    checked = 0
    for path, variable in nnx.to_flat_state(state):
        array = variable.get_value()
        assert isinstance(array.sharding, NamedSharding)
        assert array.sharding.mesh == mesh, path
        assert array.sharding.spec == expected[path[-1]], path
        checked += 1
    return checked


def test_every_parameter_follows_the_training_table(meshes, actor):
    _, params = actor
    assert _check_specs(params, TRAIN_SPECS, meshes.train) == 2 + 12 + 1
    gate = params["model"]["layers"][0]["mlp"]["gate_proj"].get_value()
    assert gate.addressable_shards[0].data.shape == (16, 64)  # 64/fsdp 4, 128/tensor 2


def test_generation_shardings_follow_the_generation_table(meshes, actor):
    _, params = actor
    shardings = state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES)
    placed = jax.device_put(params, shardings)
    _check_specs(placed, GENERATE_SPECS, meshes.generate)
    gate = placed["model"]["layers"][0]["mlp"]["gate_proj"].get_value()
    assert gate.addressable_shards[0].data.shape == (64, 64)


def test_init_sharded_matches_an_unsharded_init(actor):
    _, params = actor
    # Same jitted initialiser without shardings: bit-identical (mesh-independent RNG).
    reference = jax.jit(lambda: nnx.state(CausalLM(TINY, nnx.Rngs(0))))()
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_critic_score_head_and_loader_callable(meshes):
    _, critic_rules = role_rules("critic")
    assert critic_rules is CRITIC_RULES
    critic = init_sharded(SequenceClassifier, TINY, meshes.train, CRITIC_RULES, seed=1)
    assert critic.score.get_value().sharding.spec == P("fsdp", None)  # one label: replicated
    to_sharding = sharding_fn(meshes.train, ACTOR_TRAIN_RULES)
    sharding = to_sharding(("vocab", "embed"), (256, 64))
    assert sharding == NamedSharding(meshes.train, P(("tensor", "fsdp"), None))
