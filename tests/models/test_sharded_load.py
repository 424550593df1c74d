"""Loading straight into shardings on the 8-device CPU mesh gives the single-device model."""

import jax
import numpy as np
import pytest
from flax import nnx
from hf_testing import max_valid_diff, our_logits
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from hybridjax.models.hf_io import load_pretrained, save_pretrained

# A plain FSDP × tensor-parallel mapping, independent of hybridjax.sharding's rule tables.
RULES = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))


def simple_shardings(mesh):
    """(axes, shape) -> NamedSharding; a dimension the mesh axis does not divide is replicated."""

    def fn(axes, shape):
        spec = []
        for name, size in zip(axes, shape, strict=True):
            axis = RULES.get(name)
            spec.append(axis if axis and size % mesh.shape[axis] == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*spec))

    return fn


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sharded_load_equals_single_device(family, mesh, hf_checkpoints, padded_batch):
    path, _ = hf_checkpoints[family]
    calls = []

    def recording(axes, shape):
        calls.append((axes, shape))
        return simple_shardings(mesh)(axes, shape)

    sharded = load_pretrained(path, shardings=recording)
    single = load_pretrained(path)

    params = nnx.to_flat_state(nnx.state(sharded, nnx.Param))
    assert len(calls) == len(params)  # asked once per parameter, with its logical axes
    by_path = {p: v.get_value() for p, v in params}
    q = by_path[("model", "layers", 0, "self_attn", "q_proj")]  # D×H×Dh = 64×4×16
    assert q.sharding.spec == PartitionSpec("fsdp", "tensor", None)
    assert {s.data.shape for s in q.addressable_shards} == {(32, 1, 16)}
    k = by_path[("model", "layers", 0, "self_attn", "k_proj")]  # 2 kv heads: not split 4 ways
    assert k.sharding.spec == PartitionSpec("fsdp", None, None)
    for p, v in nnx.to_flat_state(nnx.state(single, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(by_path[p]), np.asarray(v.get_value()))

    mask = padded_batch[1]
    sharded_out = our_logits(sharded, padded_batch)
    assert max_valid_diff(sharded_out, our_logits(single, padded_batch), mask) <= 1e-5


def test_save_from_sharded_model_writes_the_same_tensors(mesh, hf_checkpoints, tmp_path):
    path, _ = hf_checkpoints["llama"]
    sharded = load_pretrained(path, shardings=simple_shardings(mesh))
    save_pretrained(sharded, tmp_path, max_shard_size_bytes=100_000)
    written = {}
    for file in tmp_path.glob("model-*.safetensors"):
        written.update(load_file(str(file)))
    original = load_file(str(path / "model.safetensors"))
    assert written.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_scanned_layers_over_sharded_parameters_equal_single_device(
    mesh, hf_checkpoints, padded_batch
):
    """`scan_layers`: stored stacked parameters sharded over fsdp × tensor (the layer axis
    replicated) scan to the single-device logits."""
    path, _ = hf_checkpoints["qwen2"]
    scan = {"scan_layers": True, "remat": True}
    sharded = load_pretrained(path, shardings=simple_shardings(mesh), config_overrides=scan)
    single = load_pretrained(path)
    mask = padded_batch[1]
    sharded_out = our_logits(sharded, padded_batch)
    assert max_valid_diff(sharded_out, our_logits(single, padded_batch), mask) <= 1e-5
