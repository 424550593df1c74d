"""Offload to host memory and back: exact values, host memory kind while offloaded."""

import jax
import numpy as np
import optax
from ml_collections import ConfigDict

from hybridjax.sharding import OffloadConfig, host_memory_kind, load_to_device, offload_to_host


def test_cpu_offers_pinned_host_memory():
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert host_memory_kind() == "pinned_host"
    assert {"device", "pinned_host"} <= kinds


def test_params_and_optimizer_state_round_trip_through_host(actor):
    _, params = actor
    opt_state = optax.adamw(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + 1.5, opt_state)  # non-zero moments, count 1
    state = {"params": params, "opt": opt_state}

    offloaded = offload_to_host(state)
    leaves, on_host = jax.tree.leaves(state), jax.tree.leaves(offloaded)
    assert len(on_host) == len(leaves) > 15
    for before, after in zip(leaves, on_host, strict=True):
        assert after.sharding.memory_kind == "pinned_host"
        assert after.sharding == before.sharding.with_memory_kind("pinned_host")
        assert all(s.data.sharding.memory_kind == "pinned_host" for s in after.addressable_shards)

    restored = load_to_device(offloaded)
    for before, after in zip(leaves, jax.tree.leaves(restored), strict=True):
        assert after.sharding == before.sharding  # device memory, same mesh and spec
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_load_to_device_leaves_device_arrays_and_python_values_alone(actor):
    _, params = actor
    leaf = params["lm_head"].get_value()
    tree = {"w": leaf, "step": 3, "none": None}
    assert load_to_device(tree)["w"] is leaf
    assert offload_to_host(tree)["step"] == 3


def test_offload_config_reads_verl_keys():
    config = ConfigDict(dict(fsdp_config=dict(param_offload=True, optimizer_offload=False)))
    assert OffloadConfig.from_config(config.fsdp_config) == OffloadConfig(True, False)
    assert OffloadConfig.from_config(ConfigDict()) == OffloadConfig(False, False)
    assert OffloadConfig.from_config(None) == OffloadConfig()
