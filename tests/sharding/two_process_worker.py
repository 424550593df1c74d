"""One process of the two-process test: 4 CPU devices each, gloo collectives over localhost.

Run as `python two_process_worker.py PROCESS_ID PORT OUT_DIR`. `relayout_and_forward` is also
called in-process by the test on 8 devices, so both sides run the very same code.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from sharding_testing import GENERATE_MESH, TINY, TRAIN_MESH

from hybridjax.models.decoder import CausalLM
from hybridjax.sharding import (
    ACTOR_GENERATE_RULES,
    ACTOR_TRAIN_RULES,
    MeshConfig,
    init_sharded,
    make_meshes,
    named_sharding,
    state_shardings,
    update_weights,
)


def _replicated(tree, mesh):
    """Every leaf as a full numpy copy (works when arrays span processes)."""
    gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))
    return [np.asarray(gather(x).addressable_data(0)) for x in jax.tree.leaves(tree)]


def relayout_and_forward() -> dict[str, np.ndarray]:
    """Init in the training layout, re-lay into generation, forward a fixed batch there, and
    move back. Returns gathered logits, generation-layout parameters and the round-trip error."""
    meshes = make_meshes(MeshConfig(train=TRAIN_MESH, generate=GENERATE_MESH))
    graphdef, params = nnx.split(init_sharded(CausalLM, TINY, meshes.train, ACTOR_TRAIN_RULES))
    gen_params, nbytes = update_weights(
        params, state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES)
    )
    ids_np = (np.arange(4 * 12).reshape(4, 12) * 37 % TINY.vocab_size).astype(np.int32)
    mask_np = np.ones((4, 12), bool)
    mask_np[1, :5] = False
    batch = named_sharding(("batch", "length"), (4, 12), meshes.generate, ACTOR_GENERATE_RULES)
    ids, mask = (
        jax.make_array_from_callback(a.shape, batch, lambda i, a=a: a[i])  # type: ignore[misc]
        for a in (
            ids_np,
            mask_np,
        )
    )
    forward = jax.jit(
        lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask),
        out_shardings=NamedSharding(meshes.generate, PartitionSpec()),
    )
    logits = np.asarray(forward(gen_params, ids, mask).addressable_data(0))
    back, _ = update_weights(gen_params, state_shardings(params, meshes.train, ACTOR_TRAIN_RULES))
    error = jax.jit(
        lambda a, b: sum(jnp.abs(x - y).max() for x, y in zip(a, b, strict=True)),
        out_shardings=NamedSharding(meshes.train, PartitionSpec()),
    )(jax.tree.leaves(params), jax.tree.leaves(back))
    return dict(
        logits=logits,
        roundtrip_error=np.asarray(error.addressable_data(0)),
        nbytes=np.asarray(nbytes),
        **{f"gen_{i}": x for i, x in enumerate(_replicated(gen_params, meshes.generate))},
    )


if __name__ == "__main__":
    process_id, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    result = relayout_and_forward()
    np.savez(f"{out_dir}/process_{process_id}.npz", **result)  # type: ignore[arg-type]
    jax.distributed.shutdown()
