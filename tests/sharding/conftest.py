"""Shared fixtures: a tiny Qwen2-shaped model and the two meshes over the 8 simulated devices."""

import pytest
from flax import nnx

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, init_sharded, make_meshes

# vocab, mlp and head counts divisible by tensor=2; embed (64) by fsdp=4.
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
)
TRAIN_MESH = (1, 4, 2)  # data, fsdp, tensor
GENERATE_MESH = (-1, 2)  # data (= 4), tensor


@pytest.fixture(scope="session")
def meshes():
    return make_meshes(MeshConfig(train=TRAIN_MESH, generate=GENERATE_MESH))


@pytest.fixture(scope="session")
def actor(meshes):
    """The tiny actor initialised in the training layout: (graphdef, params state)."""
    return nnx.split(init_sharded(CausalLM, TINY, meshes.train, ACTOR_TRAIN_RULES, seed=0))
