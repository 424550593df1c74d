"""The hybrid engine: two meshes over one device set, rule tables, re-layout and offload.

meshes = make_meshes(MeshConfig.from_config(config))
actor = init_sharded(CausalLM, model_config, meshes.train, ACTOR_TRAIN_RULES, seed)
_, params = nnx.split(actor)
gen_shardings = state_shardings(params, meshes.generate, ACTOR_GENERATE_RULES)
gen_params, nbytes = update_weights(params, gen_shardings, dtype=jnp.bfloat16)
"""

from hybridjax.sharding.mesh import (
    BATCH_AXES,
    GENERATE_AXES,
    TRAIN_AXES,
    HybridMeshes,
    MeshConfig,
    make_meshes,
    resolve_sizes,
)
from hybridjax.sharding.offload import (
    OffloadConfig,
    host_memory_kind,
    load_to_device,
    offload_to_host,
)
from hybridjax.sharding.reshard import RESHARD_BYTES_METRIC, move_memory_bytes, update_weights
from hybridjax.sharding.rules import (
    ACTOR_GENERATE_RULES,
    ACTOR_TRAIN_RULES,
    CRITIC_RULES,
    REFERENCE_RULES,
    REWARD_MODEL_RULES,
    ROLE_RULES,
    Rules,
    init_sharded,
    logical_to_spec,
    model_shardings,
    named_sharding,
    role_rules,
    sharding_fn,
    state_shardings,
)
from hybridjax.sharding.validate import check_parallelism, parallelism_problems

__all__ = [
    "ACTOR_GENERATE_RULES",
    "ACTOR_TRAIN_RULES",
    "CRITIC_RULES",
    "GENERATE_AXES",
    "REFERENCE_RULES",
    "RESHARD_BYTES_METRIC",
    "REWARD_MODEL_RULES",
    "ROLE_RULES",
    "TRAIN_AXES",
    "BATCH_AXES",
    "HybridMeshes",
    "MeshConfig",
    "OffloadConfig",
    "Rules",
    "check_parallelism",
    "host_memory_kind",
    "init_sharded",
    "load_to_device",
    "logical_to_spec",
    "make_meshes",
    "model_shardings",
    "move_memory_bytes",
    "named_sharding",
    "offload_to_host",
    "parallelism_problems",
    "resolve_sizes",
    "role_rules",
    "sharding_fn",
    "state_shardings",
    "update_weights",
]
