"""The packed reward-model scoring compiled by XLA:GPU for a compile-only A100 and H100 on this
CPU machine (`reward_model.model.use_remove_padding`, the default).

A float32 response mask concatenated to an int32 prompt mask and cast back after the concat
put a float-to-int convert between the concat and the prompt/response slices the packing plan
sums; XLA:GPU's Triton reduction emitter (JAX 0.10.2) then failed on that fusion whenever the
two widths differ (`'scf.if' op ... tensor<1x1xf32> should match ... tensor<1x512xf32>` at
512 + 1024), so the 7B PPO recipe's `reward` stage did not compile. 8 rows of 64 + 128 tokens
trigger it too (2 rows, or 16 + 32 tokens, did not).

On 8 GPUs under FSDP the packed buffers' rows stay split over the devices (the per-layer loop
pins them, as `decoder.scan_layers` does): unpinned, XLA:GPU all-gathered the buffers'
activations, so every device ran every row (the 7B reward model's temp: 15.1 GB, against 1.8 GB
pinned). Skipped without JAX's CUDA plugin (`hybridjax[gpu-aot]`).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hybridjax.memory import gpu_targets
from hybridjax.memory.resident import abstract_model
from hybridjax.models import SequenceClassifier
from hybridjax.models.packing import PackingConfig
from hybridjax.rewards.reward_model import score_responses
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, make_meshes
from hybridjax.sharding.mesh import pass_mesh
from tests.rewards.test_reward_model import CONFIG

B, P, R = 8, 64, 128  # unequal widths (equal ones compiled before too), 8 rows (2 did)


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_packed_scoring_compiles_for_the_gpu(target):
    if problem := gpu_targets.missing_plugin(target):
        pytest.skip(problem)
    sharding = SingleDeviceSharding(gpu_targets.compile_only_devices(target, 1)[0])
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    graphdef, state = nnx.split(nnx.eval_shape(lambda: SequenceClassifier(CONFIG, nnx.Rngs(0))))
    state = jax.tree.map(lambda x: sds(x.shape, x.dtype), state)
    # the trainer's dtypes: int32 prompt ids and mask, a float32 response mask (`RLBatch`)
    args = (sds((B, P), jnp.int32), sds((B, P), jnp.int32), sds((B, R), jnp.int32))
    args += (sds((B, R), jnp.float32),)
    packing = PackingConfig(P + R, 1, pieces=1)
    lowered = score_responses.lower(graphdef, state, *args, packing=packing)
    assert lowered.compile().memory_analysis() is not None


def test_packed_scoring_keeps_its_rows_split_over_8_gpus():
    if problem := gpu_targets.missing_plugin("a100"):
        pytest.skip(problem)
    devices = gpu_targets.compile_only_devices("a100", 8)
    mesh = make_meshes(MeshConfig(train=(1, 1, 8, 1), generate=(8, 1)), devices).train
    graphdef, state = abstract_model(SequenceClassifier, CONFIG, mesh, ACTOR_TRAIN_RULES)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)  # noqa: E731
    b = 8 * B  # 8 rows per device
    args = (sds((b, P), jnp.int32), sds((b, P), jnp.int32), sds((b, R), jnp.int32))
    args += (sds((b, R), jnp.float32),)
    packing = PackingConfig(P + R, 2, pieces=8)
    with pass_mesh(mesh):
        hlo = score_responses.lower(graphdef, state, *args, packing=packing).compile().as_text()
    gathered = re.findall(r"= \(?[a-z0-9]+\[([0-9,]*)\][^\n]*? all-gather(?:-start)?\(", hlo)
    assert not [s for s in gathered if str(P + R) in s.split(",")], gathered  # buffer rows
