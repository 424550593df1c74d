"""Frozen models in the compute dtype: the reference (`ref.fsdp_config.model_dtype`, verl's
key) and the reward model (`reward_model.model.dtype`) hold bfloat16 parameters when asked."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from hybridjax.errors import ConfigError
from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.models.hf_io import save_pretrained
from hybridjax.rl.checks import validate
from hybridjax.sharding import MeshConfig, make_meshes
from hybridjax.training import build
from tests.reliability.test_config_checks import _config


def test_reference_copy_takes_model_dtype_and_keeps_shardings():
    c = _config(**{"actor_rollout_ref.ref.fsdp_config.model_dtype": "bfloat16"})
    params = nnx.state(CausalLM(build.actor_model_config(c, build.load_tokenizer(c)), nnx.Rngs(0)))
    ref = build.frozen_copy(params, c)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
        assert a.sharding == b.sharding
        assert jnp.array_equal(a.astype(jnp.bfloat16), b)


def test_reward_model_loads_in_its_dtype(tmp_path):
    c = _config()
    shape = dataclasses.replace(build.actor_model_config(c, build.load_tokenizer(c)), num_labels=1)
    save_pretrained(SequenceClassifier(shape, nnx.Rngs(1)), tmp_path / "rm")
    c.reward_model.model.path = str(tmp_path / "rm")
    c.reward_model.model.dtype = "bfloat16"
    mesh = make_meshes(MeshConfig(train=(1, 1, 1, 1), generate=(1, 1)), jax.devices()[:1]).train
    rm = build.build_reward_model(c, mesh)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(rm))} == {jnp.dtype(jnp.bfloat16)}
    assert rm.config.dtype == "bfloat16"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"reward_model.model.dtype": "fp8"}, "reward_model.model.dtype"),
        (
            {
                "actor_rollout_ref.model.lora_rank": 4,
                "actor_rollout_ref.ref.fsdp_config.model_dtype": "bfloat16",
            },
            "base weights",
        ),
    ],
)
def test_bad_frozen_dtypes_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        validate(_config(**changes), 8)
