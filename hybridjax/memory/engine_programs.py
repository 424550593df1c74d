"""The rollout engine's device programs, compiled from abstract inputs for the planner.

An `Engine` places its weights and allocates its KV pool when built, which compile-only
devices (`hybridjax.memory.gpu_targets`) cannot do. Its jitted prefill, extend and decode calls
are a `hybridjax.rollout.programs.Programs`, which holds neither: `abstract_programs` builds
one as `Engine.__init__` does, and `engine_memory` lowers them
at the largest shapes a rollout compiles and returns XLA's memory analysis of each:

* prefill: `prefill_bucket(rows)` rows per replica of `prefill_bucket(prompt_length)` tokens,
  rows = the prompts one step's token budget (`max_num_batched_tokens`) holds, at most
  `max_num_seqs`;
* extend: the same rows and length, page tables `pages_per_seq` wide (chunked prefill's
  later chunks, multi-turn appends);
* decode: `max_num_seqs` rows per replica, page tables `pages_per_seq` wide,
  `decode_steps_per_call` steps, top-k/p filtering as the sampling parameters ask.

The decode kernel is the one the engine selects for the mesh's platform
(`select_decode_kernel(rollout.attention_impl, ..., platform_of(mesh))`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.platforms import platform_of
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.decode_attention import select_decode_kernel
from hybridjax.rollout.paged_cache import PagedKVCache
from hybridjax.rollout.pages import num_pages
from hybridjax.rollout.programs import Programs
from hybridjax.rollout.replicas import ROWS_SPEC
from hybridjax.rollout.slots import Slots, prefill_bucket
from hybridjax.sharding.mesh import pass_mesh


def abstract_programs(
    graphdef: Any, model_config: Any, config: RolloutConfig, mesh: Mesh
) -> Programs:
    """The engine's jitted programs for `mesh` (`prefill_jit`, `extend_jit`, `decode_jit`),
    without routing replay, to lower from abstract inputs."""
    window = model_config.sliding_window
    impl = select_decode_kernel(config.attention_impl, window, platform_of(mesh))
    return Programs(graphdef, model_config, config, mesh, impl, None)


def _memory(lowered: Any) -> dict[str, int]:
    m = lowered.compile().memory_analysis()
    return {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "scratch": m.temp_size_in_bytes,
    }


def engine_memory(
    graphdef: Any,
    params: Any,
    model_config: Any,
    rollout: Any,
    mesh: Mesh,
    pages: int,
) -> dict[str, dict[str, int]]:
    """XLA's per-device memory analysis of the engine's prefill, extend and decode calls.

    Args:
      graphdef, params: the rollout's model, params as ShapeDtypeStructs in the generation
        layout (`planner.abstract_model(..., ACTOR_GENERATE_RULES, rollout dtype)`).
      model_config: its ModelConfig.
      rollout: the `actor_rollout_ref.rollout` ConfigDict.
      mesh: the generation mesh (`data` replicas × `tensor`).
      pages: KV pages per replica (as the planner sizes the pool).
    Returns:
      {"prefill" | "extend" | "decode": {"arguments", "outputs", "aliased", "scratch"}}
      (bytes per device).
    """
    config = RolloutConfig.from_config(rollout)
    programs = abstract_programs(graphdef, model_config, config, mesh)
    replicas = programs.replicas
    pool_sharding = NamedSharding(mesh, programs.pool_spec())
    shapes = jax.eval_shape(
        lambda: PagedKVCache.create_pool(
            model_config, replicas * pages, config.page_size, programs.kv_dtype
        )
    )
    k, v = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pool_sharding), shapes
    )
    row = NamedSharding(mesh, ROWS_SPEC)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=row)
    budget_rows = max(config.max_num_batched_tokens // max(config.prompt_length, 1), 1)
    n = replicas * prefill_bucket(min(budget_rows, config.max_num_seqs))
    t = prefill_bucket(config.prompt_length, config.min_prefill_bucket)
    ids, mask = spec((n, t), jnp.int32), spec((n, t), jnp.bool_)
    out = {}
    with pass_mesh(mesh):
        table = spec((n, num_pages(t, config.page_size)), jnp.int32)
        out["prefill"] = _memory(programs.prefill_jit.lower(params, k, v, ids, mask, table))
        table = spec((n, config.pages_per_seq), jnp.int32)
        start = spec((n,), jnp.int32)
        out["extend"] = _memory(programs.extend_jit.lower(params, k, v, ids, start, mask, table))
        host = Slots.empty(replicas * config.max_num_seqs, config.pages_per_seq)
        fields = {
            f.name: spec(np.shape(x), np.asarray(x).dtype)
            for f in dataclasses.fields(host)
            if (x := getattr(host, f.name)) is not None
        }
        batch = Slots(**fields)
        limit = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
        use_filter = SamplingParams.from_config(rollout).uses_filter
        steps = config.decode_steps_per_call
        lowered = programs.decode_jit.lower(
            params, k, v, batch, limit, num_steps=steps, use_filter=use_filter
        )
        out["decode"] = _memory(lowered)
    return out
