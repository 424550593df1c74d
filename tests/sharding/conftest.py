"""Shared fixtures: a tiny Qwen2-shaped model and the two meshes over the 8 simulated devices."""

import pytest
from flax import nnx
from sharding_testing import GENERATE_MESH, TINY, TRAIN_MESH

from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, init_sharded, make_meshes


@pytest.fixture(scope="session")
def meshes():
    return make_meshes(MeshConfig(train=TRAIN_MESH, generate=GENERATE_MESH))


@pytest.fixture(scope="session")
def actor(meshes):
    """The tiny actor initialised in the training layout: (graphdef, params state)."""
    return nnx.split(init_sharded(CausalLM, TINY, meshes.train, ACTOR_TRAIN_RULES, seed=0))
