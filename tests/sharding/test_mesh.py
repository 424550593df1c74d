"""Mesh construction from config: sizes, -1, and the shared device order of both meshes."""

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from hybridjax.sharding import MeshConfig, resolve_sizes


def test_resolve_sizes_fills_the_rest():
    assert resolve_sizes((-1, 2, 2), 8) == (2, 2, 2)
    assert resolve_sizes((1, -1, 1), 8) == (1, 8, 1)
    assert resolve_sizes((4, 2), 8) == (4, 2)


@pytest.mark.parametrize("sizes", [(-1, -1, 2), (3, -1, 1), (2, 2, 1), (0, 8, 1), (-2, 4, 1)])
def test_resolve_sizes_rejects_what_does_not_fit(sizes):
    with pytest.raises(ValueError, match="mesh.train"):
        resolve_sizes(sizes, 8, "mesh.train")


def test_mesh_config_from_config_dict():
    config = ConfigDict(
        dict(mesh=dict(train=dict(data=2, fsdp=-1, tensor=2), generate=dict(data=-1, tensor=4)))
    )
    mesh_config = MeshConfig.from_config(config)
    assert mesh_config == MeshConfig(train=(2, 1, -1, 2), generate=(-1, 4))
    assert mesh_config.train_sizes(8) == {"data": 2, "expert": 1, "fsdp": 2, "tensor": 2}
    assert mesh_config.generate_sizes(8) == {"data": 2, "tensor": 4}


def test_meshes_share_devices_and_tensor_groups(meshes):
    assert dict(meshes.train.shape) == {"data": 1, "expert": 1, "fsdp": 4, "tensor": 2}
    assert dict(meshes.generate.shape) == {"data": 4, "tensor": 2}
    assert set(meshes.train.devices.flat) == set(jax.devices())
    assert set(meshes.generate.devices.flat) == set(jax.devices())
    # Same tensor size: each tensor-parallel group holds the same devices in both layouts.
    train_groups = meshes.train.devices.reshape(-1, 2)
    np.testing.assert_array_equal(train_groups, meshes.generate.devices)
    assert meshes.train.axis_types == (jax.sharding.AxisType.Auto,) * 4


def test_mesh_for_names_the_layouts(meshes):
    assert meshes.mesh_for("generate") is meshes.generate
    with pytest.raises(ValueError, match="'train' or 'generate'"):
        meshes.mesh_for("rollout")
