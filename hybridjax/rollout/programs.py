"""The rollout engine's jitted device calls: prefill, extend, page copy and the decode loop,
each run by every data-parallel replica on its own block of rows and its own pages
(`replicas.per_replica`), and the host-side packing of rows into their (batch, length) buckets.

`Programs` holds no weights and no pool: its calls take them and return the new pools, so
`hybridjax.memory.engine_programs` builds one for compile-only devices and lowers the same
programs the engine runs. Compiles are counted by shape (`compile_counts`) and logged on the
engine's logger.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.models.config import to_dtype
from hybridjax.rollout import steps
from hybridjax.rollout.config import RolloutConfig
from hybridjax.rollout.paged_cache import PagedKVCache, copy_pages, pool_spec, stacked_layout
from hybridjax.rollout.pages import num_pages
from hybridjax.rollout.replicas import ROWS_SPEC, per_replica
from hybridjax.rollout.routing import Routing, row_routing
from hybridjax.rollout.slots import Slots, power_of_two_bucket, prefill_bucket

# the engine's logger: a compile is the engine's event (`INFO hybridjax.rollout.engine: compiling`)
log = logging.getLogger("hybridjax.rollout.engine")

Pools = tuple[Any, Any]  # (k, v) pools of every replica (`paged_cache.stacked_layout`)


def mesh_axis(mesh: Mesh | None, name: str) -> int:
    """The size of `mesh`'s axis `name`, 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[name]


def pool_pages(config: RolloutConfig, model_config: Any, mesh: Mesh | None, state: Any) -> int:
    """Pages per layer and replica of an engine's pools: explicit (`config.num_pages`), else
    from what is free after the weights `state` on the engine's devices
    (`PagedKVCache.pages_from_memory`: the tightest of this process's devices of the mesh),
    else the CPU default (`config.default_num_pages`). Host sync: waits for the weights."""
    if config.num_pages:
        return config.num_pages
    devices = [jax.local_devices()[0]]
    if mesh is not None:
        here = jax.process_index()
        devices = [d for d in mesh.devices.flat if d.process_index == here]
    jax.block_until_ready(state)  # the weights are placed before memory is read
    per_page = PagedKVCache.page_bytes(
        model_config, config.page_size, to_dtype(model_config.dtype), mesh_axis(mesh, "tensor")
    )
    frac = config.gpu_memory_utilization
    pages = PagedKVCache.pages_from_memory([d.memory_stats() for d in devices], frac, per_page)
    if pages is None:
        log.info("no device memory statistics; %d pages", config.default_num_pages)
        return config.default_num_pages
    log.info("%d pages of %d bytes from %.2f of the free bytes", pages, per_page, frac)
    return pages


class Programs:
    """The jitted prefill, page-copy, extend and decode calls of an engine.

    Args:
      graphdef: the model's `nnx.GraphDef` (the weights come with each call).
      model_config: its `ModelConfig`.
      config: the engine's `RolloutConfig` (the engine keeps it in step with its own).
      mesh: optional generation mesh ("data", "tensor"): one replica per index of `data`.
      impl: the decode attention kernel (`decode_attention.select_decode_kernel`).
      routing_shape: (MoE layers, experts per token) to record each computed token's experts
        (routing replay), or None.

    Compiles: one per prefill/extend bucket (batch, length), one per decode variant, one per
    page-copy bucket; `compile_counts` counts them by shape (each is also logged).
    """

    def __init__(
        self,
        graphdef: Any,
        model_config: Any,
        config: RolloutConfig,
        mesh: Mesh | None,
        impl: Any,
        routing_shape: tuple[int, int] | None,
    ):
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config
        self.mesh = mesh
        self.impl = impl
        self.kv_dtype = to_dtype(model_config.dtype)
        # one L×K×N×S×D array per pool for a model that scans its layers, else one per layer
        self.stacked = stacked_layout(model_config)
        self.routing_shape = routing_shape
        self.record_routing = routing_shape is not None
        self.replicas = mesh_axis(mesh, "data")
        self.compile_counts: collections.Counter[str] = collections.Counter()
        pool, rows, whole = self.replica_spec(), ROWS_SPEC, PartitionSpec()
        self.prefill_jit = jax.jit(
            per_replica(
                self._prefill_fn, mesh, (whole, pool, pool, rows, rows, rows), (pool, pool, rows)
            ),
            donate_argnums=(1, 2),
        )
        self.copy_jit = jax.jit(
            per_replica(self._copy_fn, mesh, (pool, pool, rows, rows), pool), donate_argnums=(0, 1)
        )
        extend_specs = (whole, pool, pool, rows, rows, rows, rows)
        self.extend_jit = jax.jit(
            per_replica(self._extend_fn, mesh, extend_specs, (pool, pool, rows)),
            donate_argnums=(1, 2),
        )
        self.decode_jit = jax.jit(
            self._decode_call, donate_argnums=(1, 2), static_argnames=("num_steps", "use_filter")
        )

    # ----------------------------------------------------------------------------- layout

    def _kv_heads_axis(self) -> str | None:
        kv, tp = self.model_config.num_key_value_heads, mesh_axis(self.mesh, "tensor")
        return "tensor" if kv % tp == 0 and tp > 1 else None

    def pool_spec(self) -> PartitionSpec:
        """A pool's sharding: kv heads over `tensor`, pages by replica over `data` (a stacked
        pool's layer axis whole)."""
        return pool_spec(self.stacked, self._kv_heads_axis(), "data")

    def replica_spec(self) -> PartitionSpec:
        """A pool's spec in `per_replica` (which names only `data`): pages by replica."""
        return pool_spec(self.stacked, None, "data")

    def pool_creator(self, pages: int):
        """The jitted zeros of the KV pools (k, v) of `pages` pages per replica: one
        K×(R·N)×S×D array per layer, or one stacked L×K×(R·N)×S×D array each for a scanned
        model (`paged_cache.stacked_layout`). Each device holds only its replica's N pages
        (created in place through `out_shardings`, never whole on one device). Built once per
        engine, so waking after `sleep` reuses its compiled program."""
        create = functools.partial(
            PagedKVCache.create_pool,
            self.model_config,
            self.replicas * pages,
            self.config.page_size,
            self.kv_dtype,
        )
        if self.mesh is None:
            return jax.jit(create)
        return jax.jit(create, out_shardings=NamedSharding(self.mesh, self.pool_spec()))

    def _constrain_pools(self, pools):
        """Inside a replica's step: its pool keeps its kv heads split over `tensor`."""
        if self.mesh is None:
            return pools
        spec = pool_spec(self.stacked, self._kv_heads_axis())
        return jax.lax.with_sharding_constraint(pools, spec)

    def upload(self, batch):
        """A row batch (R blocks, `replicas.ROWS_SPEC`) on the devices, block r on replica r."""
        if self.mesh is None:
            return jax.device_put(batch)
        return jax.device_put(batch, NamedSharding(self.mesh, ROWS_SPEC))

    def _traced(self, name: str) -> None:
        """Called while tracing: counts (and logs) a compile."""
        self.compile_counts[name] += 1
        log.info("compiling %s (%d compiles so far)", name, self.num_compiles)

    @property
    def num_compiles(self) -> int:
        return sum(self.compile_counts.values())

    # ----------------------------------------------------------------------------- traced

    def _prefill_fn(self, state, k_pools, v_pools, ids_NxT, mask_NxT, page_table_NxP):
        self._traced(f"prefill{ids_NxT.shape}")
        k, v, routed = steps.prefill(
            self.graphdef,
            state,
            k_pools,
            v_pools,
            ids_NxT,
            mask_NxT,
            page_table_NxP,
            self.model_config.sliding_window,
            self.record_routing,
        )
        return self._constrain_pools(k), self._constrain_pools(v), routed

    def _extend_fn(self, state, k_pools, v_pools, ids_NxT, start_N, mask_NxT, page_table_NxP):
        self._traced(f"extend{ids_NxT.shape}")
        k, v, routed = steps.extend(
            self.graphdef,
            state,
            k_pools,
            v_pools,
            ids_NxT,
            start_N,
            mask_NxT,
            page_table_NxP,
            self.model_config.sliding_window,
            self.record_routing,
        )
        return self._constrain_pools(k), self._constrain_pools(v), routed

    def _copy_fn(self, k_pools, v_pools, src_C, dst_C):
        self._traced(f"copy_pages{src_C.shape}")
        k, v = copy_pages(k_pools, v_pools, src_C, dst_C)
        return self._constrain_pools(k), self._constrain_pools(v)

    def _decode_call(self, state, k_pools, v_pools, batch: Slots, exit_when_done, **static):
        rows, width = batch.page_table.shape
        self._traced(
            f"decode(rows={rows}, steps={static['num_steps']}, filter={static['use_filter']}, "
            f"pages={width})"
        )
        pool, rows_spec, whole = self.replica_spec(), ROWS_SPEC, PartitionSpec()
        fn = per_replica(
            functools.partial(self._decode_fn, **static),
            self.mesh,
            (whole, pool, pool, rows_spec, whole),
            (pool, pool, rows_spec, rows_spec, rows_spec, rows_spec, rows_spec, rows_spec),
        )
        return fn(state, k_pools, v_pools, batch, exit_when_done)

    def _decode_fn(self, state, k_pools, v_pools, batch: Slots, exit_when_done, **static):
        """One replica's decode loop (`steps.decode_loop`); its step count as a 1-vector."""
        k, v, dyn, n_steps, *out = steps.decode_loop(
            self.graphdef,
            state,
            k_pools,
            v_pools,
            batch,
            exit_when_done,
            impl=self.impl,
            sliding_window=self.model_config.sliding_window,
            mesh=self.mesh,
            constrain_pools=self._constrain_pools,
            routing_shape=self.routing_shape,
            **static,
        )
        return k, v, dyn, n_steps[None], *out

    # ----------------------------------------------------------------------------- host calls

    def prefill_rows(
        self, state: Any, pools: Pools, rows: list[tuple[int, Sequence[int], list[int]]]
    ) -> tuple[Pools, list[Routing | None], int]:
        """Writes the keys/values of (replica, token ids at positions 0.., pages) rows in one
        prefill call, padded to a (batch, length) bucket. Returns the new pools, per row its
        experts with routing replay (`Routing`), else None (and None for a row without
        tokens), and the tokens computed (padding excluded). Host sync: none."""
        todo = [row for row in rows if len(row[1])]
        if not todo:
            return pools, [None] * len(rows), 0
        groups = [[x for x in todo if x[0] == r] for r in range(self.replicas)]
        n = prefill_bucket(max(len(g) for g in groups))
        t = prefill_bucket(max(len(x[1]) for x in todo), self.config.min_prefill_bucket)
        ids = np.zeros((self.replicas, n, t), np.int32)
        mask = np.zeros((self.replicas, n, t), bool)
        table = np.zeros((self.replicas, n, num_pages(t, self.config.page_size)), np.int32)
        for r, group in enumerate(groups):
            for row, (_, tokens, pages) in enumerate(group):
                ids[r, row, : len(tokens)] = tokens
                mask[r, row, : len(tokens)] = True
                table[r, row, : len(pages)] = pages
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        k, v, routed = self.prefill_jit(
            state, *pools, *self.upload((flat(ids), flat(mask), flat(table)))
        )
        chunks = row_routing(self.record_routing, routed, groups, n, rows, lambda x: len(x[1]))
        return (k, v), chunks, int(mask.sum())

    def extend_rows(
        self, state: Any, pools: Pools, rows: list[tuple[int, int, Sequence[int], list[int]]]
    ) -> tuple[Pools, list[Routing | None], int]:
        """Writes the keys/values of (replica, start, token ids at positions start.., pages)
        rows on top of their cached positions 0 .. start-1, in one call padded to a (batch,
        length) bucket (`steps.extend`). Returns what `prefill_rows` does. Host sync: none."""
        if not rows:
            return pools, [], 0
        groups = [[x for x in rows if x[0] == r] for r in range(self.replicas)]
        n = prefill_bucket(max(len(g) for g in groups))
        t = prefill_bucket(max(len(x[2]) for x in rows), self.config.min_prefill_bucket)
        shape = (self.replicas, n)
        ids, mask = np.zeros((*shape, t), np.int32), np.zeros((*shape, t), bool)
        start = np.zeros(shape, np.int32)
        table = np.zeros((*shape, self.config.pages_per_seq), np.int32)
        for r, group in enumerate(groups):
            for row, (_, first, tokens, pages) in enumerate(group):
                ids[r, row, : len(tokens)], mask[r, row, : len(tokens)] = tokens, True
                start[r, row] = first
                table[r, row, : len(pages)] = pages
        flat = [x.reshape(-1, *x.shape[2:]) for x in (ids, start, mask, table)]
        k, v, routed = self.extend_jit(state, *pools, *self.upload(flat))
        chunks = row_routing(self.record_routing, routed, groups, n, rows, lambda x: len(x[2]))
        return (k, v), chunks, int(mask.sum())

    def copy(self, pools: Pools, copies: list[list[tuple[int, int]]], pages: int) -> Pools:
        """Runs each replica's (source, destination) page copies (local page numbers; pools
        of `pages` pages per replica) in one call padded to a power-of-two bucket. Host sync:
        none."""
        if not any(copies):
            return pools
        c = power_of_two_bucket(max(map(len, copies)), 8)
        src = np.zeros((self.replicas, c), np.int32)
        dst = np.full((self.replicas, c), pages, np.int32)  # padding: dropped
        for r, pairs in enumerate(copies):
            if pairs:
                src[r, : len(pairs)], dst[r, : len(pairs)] = zip(*pairs, strict=True)
        return self.copy_jit(*pools, *self.upload((src.reshape(-1), dst.reshape(-1))))
