"""The rollout engine: JetStream's surface (`prefill`, `insert`, `generate`, `free_resource`) over
a paged KV cache, with decode slots refilled as sequences finish.

Life of a prompt of length L with n samples:
  1. `prefill` (`admit`, then `run_prefill`): the group is placed on one data-parallel replica
     (`hybridjax.rollout.replicas`); positions 0 .. L-2 are run once and written to fresh pages
     of that replica (several prompts per call, padded to a (batch, length) bucket). Full
     pages are shared by all n samples; the pages the group takes until its samples are
     inserted are reserved (`hybridjax.rollout.pages`).
  2. `insert` (once per sample): a free slot of that replica gets the sample's page table and
     sampling state
     (`hybridjax.rollout.slots`). Its first input is the prompt's last token at position L-1,
     so every sampled token, the first one included, comes out of the decode loop.
  3. `generate`: up to `num_steps` decode steps in one jitted `lax.while_loop` (one host round
     trip; `hybridjax.rollout.steps`) over the ACTIVE slots only: each replica's are gathered
     into its block of the decode batch, of a power-of-two size (`slots.replica_rows`), so an
     engine with
     `max_num_seqs` = 256 slots costs what one with as many slots as sequences does.
     Before each call a sequence takes the pages the call may write into ("on_demand"); when
     a replica has none free, its youngest sequences are preempted and later readmitted by
     `resume`, recomputed from their tokens (`hybridjax.rollout.preemption`).
  4. `free_resource`: the slot's pages go back to the free list.

Which sequences run and wait, admission (with its watermark), the engine step's token budget,
page growth and preemption are decided on the host by `hybridjax.rollout.scheduler` (the
engine's `scheduler`, which also holds every slot's host state); the engine runs the jitted
calls it plans.

Multi-turn (`hybridjax.rollout.agent_loop`): a slot that stopped keeps its pages; `extend` appends
tokens (a tool's response) on top of its cached keys/values, computing only the new tokens, and
re-activates it, while the other slots keep decoding.

Device state: the page pools, one per replica (and the weights). Everything else (page tables,
per-slot sampling parameters, positions) lives on the host and is uploaded with each call: a few
KB.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.models.config import to_dtype
from hybridjax.models.decoder import CausalLM
from hybridjax.models.moe import moe_layers
from hybridjax.rollout import steps
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.decode_attention import select_decode_kernel
from hybridjax.rollout.paged_cache import PagedKVCache, copy_pages, pool_spec, stacked_layout
from hybridjax.rollout.pages import Prefix, Request, num_pages
from hybridjax.rollout.preemption import Preempted, first_row
from hybridjax.rollout.replicas import ROWS_SPEC, ReplicaBooks, per_replica
from hybridjax.rollout.scheduler import Scheduler
from hybridjax.rollout.slots import (
    DYNAMIC_FIELDS,
    Slots,
    StepOutput,
    power_of_two_bucket,
    prefill_bucket,
    replica_rows,
    table_width,
)
from hybridjax.sharding.mesh import platform_of

log = logging.getLogger(__name__)

__all__ = ["Engine", "Prefix", "Request", "StepOutput"]  # re-exported

# One call's share of a sequence's recorded experts (rollout routing replay): (N×T×L×k int32
# experts of the call's rows, on device or host; the row; its first `count` tokens).
Routing = tuple[Any, int, int]


class Engine:
    """Paged-attention decoder for one `CausalLM` on one (generation) mesh.

    Args:
      model: the actor; its weights are read once (`update_weights` swaps them).
      config: engine sizes (`RolloutConfig`); `max_num_seqs` caps the running sequences of
        each replica, `num_pages` (or `gpu_memory_utilization`) sizes each replica's pool.
      mesh: optional generation mesh with axes ("data", "tensor"): one replica per index of
        `data`, with its own pages and slots (`hybridjax.rollout.replicas`); kv heads of the
        pools (and the weights' heads/mlp/vocab) over `tensor`.
      param_shardings: optional shardings of `nnx.state(model)`; by default the rollout rule
        table of `hybridjax.sharding.rules`.

    Routing replay (`config.enable_rollout_routing_replay`, a MoE model only): every prefill,
    extend and decode call also returns the experts each token it computes used in each MoE
    layer; `routing_of(slot)` hands a sequence's back, one per fed position.

    Compiles: one per prefill bucket (batch, length), one per decode variant (rows per replica:
    a power of two up to `max_num_seqs`; decode steps; top-k/p on/off; page-table width: up to
    4 widths), one per page-copy bucket; `compile_counts` counts them by shape (each is also
    logged).
    """

    def __init__(
        self,
        model: CausalLM,
        config: RolloutConfig,
        mesh: Mesh | None = None,
        param_shardings: Any = None,
    ):
        self.config = config
        self.model_config = model.config
        self.mesh = mesh
        self.graphdef, state = nnx.split(model)
        if mesh is not None and param_shardings is None:
            from hybridjax.sharding.rules import ACTOR_GENERATE_RULES, state_shardings

            param_shardings = state_shardings(state, mesh, ACTOR_GENERATE_RULES)
        self._param_shardings = param_shardings
        self.state = self._placed(state)
        window = model.config.sliding_window
        self.impl = select_decode_kernel(
            config.attention_impl,
            window,
            platform_of(mesh),
            model.config.resolved_head_dim,
            config.page_size,
        )
        self.kv_dtype = to_dtype(model.config.dtype)
        # one L×K×N×S×D array per pool for a model that scans its layers, else one per layer
        self.stacked = stacked_layout(model.config)
        layers = len(moe_layers(model))
        self.record_routing = config.enable_rollout_routing_replay
        if self.record_routing and not layers:
            raise ValueError(
                "rollout.enable_rollout_routing_replay records the experts of a MoE model; "
                "this model is dense"
            )
        self._routing_shape = (
            (layers, model.config.num_experts_per_tok) if self.record_routing else None
        )
        self.replicas = self._axis("data")
        self.num_pages = self._pool_size()  # per replica
        # the host state of every slot and sequence, and the policy over it
        self.scheduler = Scheduler(config, self.replicas, self.num_pages)
        eos = model.config.eos_token_id
        self.eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.num_decode_steps = 0  # decode-loop iterations run so far (all rows in one step)
        self.num_decode_rows = 0  # rows those iterations ran on (padding rows included)
        self.num_prefill_tokens = 0  # tokens run by prefill and extend (padding excluded)
        self.k_pools = self.v_pools = None
        # jitted once: every `wake_up` after a `sleep` runs the same program (no recompile)
        self._create_pools = self._pool_creator()
        self.wake_up()  # the KV pool (`_allocate_pools`); `sleep` releases it
        self._jit_programs()

    def _jit_programs(self) -> None:
        """The jitted prefill, page-copy, extend and decode calls (`memory.engine_programs`
        lowers them for compile-only devices, from an engine without weights or pools)."""
        mesh = self.mesh
        pool, rows, whole = self._replica_spec(), ROWS_SPEC, PartitionSpec()
        self._prefill_jit = jax.jit(
            per_replica(
                self._prefill_fn, mesh, (whole, pool, pool, rows, rows, rows), (pool, pool, rows)
            ),
            donate_argnums=(1, 2),
        )
        self._copy_jit = jax.jit(
            per_replica(self._copy_fn, mesh, (pool, pool, rows, rows), pool), donate_argnums=(0, 1)
        )
        extend_specs = (whole, pool, pool, rows, rows, rows, rows)
        self._extend_jit = jax.jit(
            per_replica(self._extend_fn, mesh, extend_specs, (pool, pool, rows)),
            donate_argnums=(1, 2),
        )
        self._decode_jit = jax.jit(
            self._decode_call, donate_argnums=(1, 2), static_argnames=("num_steps", "use_filter")
        )

    # ----------------------------------------------------------------------------- set-up

    def update_weights(self, state_or_model: Any) -> None:
        """Swaps in new weights (an `nnx.State` or a module of the same structure); same
        shapes and dtypes mean no recompile. Placed on `param_shardings` when given."""
        self.state = self._placed(state_or_model)
        self.scheduler.forget_prefixes()  # cached keys/values are the old weights'

    def _placed(self, state_or_model: Any) -> Any:
        """The weights as an `nnx.State`, on `param_shardings` when given."""
        state = state_or_model
        if isinstance(state_or_model, nnx.Module):
            state = nnx.state(state_or_model)
        if self._param_shardings is not None:
            state = jax.device_put(state, self._param_shardings)
        return state

    def sleep(self, level: int = 1) -> int:
        """Releases the KV page pool (level 1) and also the weights (level 2), as vLLM's sleep
        mode: the buffers are deleted, not only unreferenced, so training stages get the
        memory back. Level 2 is for weights that are the engine's own copy (the trainer's
        generation layout); `update_weights` brings them back. Returns the bytes released
        per device summed over devices. Raises RuntimeError while sequences are running."""
        if self.num_active or any(self._slot_history):
            raise RuntimeError("Engine.sleep: sequences still hold slots; free them first")
        if level not in (1, 2):
            raise ValueError(f"Engine.sleep: level must be 1 or 2, got {level}")
        released = [self.k_pools, self.v_pools] + ([self.state] if level == 2 else [])
        leaves = [x for x in jax.tree.leaves(released) if not x.is_deleted()]
        nbytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
        for x in leaves:
            x.delete()
        self.k_pools = self.v_pools = None
        self.scheduler.forget_prefixes()  # the pages' keys/values are gone
        if level == 2:
            self.state = None
        return nbytes

    def wake_up(self) -> None:
        """Rebuilds a released KV page pool (zeros, same pages and sharding: no recompile);
        `prefill` calls it, so a sleeping engine wakes when the next rollout starts."""
        if self.k_pools is not None:
            return
        self.k_pools, self.v_pools = self._allocate_pools()

    def _require_weights(self, caller: str) -> None:
        """Raises RuntimeError when `sleep(2)` released the weights and no `update_weights`
        brought them back: nothing can be admitted or computed until then."""
        if self.state is None:
            raise RuntimeError(f"Engine.{caller}: weights released by sleep(2); update_weights")

    @property
    def asleep(self) -> bool:
        """True between `sleep` and the next `wake_up` (no KV page pool on the devices)."""
        return self.k_pools is None

    def _pool_size(self) -> int:
        """Pages per layer and replica: explicit, else from what is free after the weights on
        the engine's devices (`PagedKVCache.pages_from_memory`: the tightest of this process's
        devices of the mesh), else the CPU default."""
        if self.config.num_pages:
            return self.config.num_pages
        devices = [jax.local_devices()[0]]
        if self.mesh is not None:
            here = jax.process_index()
            devices = [d for d in self.mesh.devices.flat if d.process_index == here]
        jax.block_until_ready(self.state)  # the weights are placed before memory is read
        per_page = PagedKVCache.page_bytes(
            self.model_config, self.config.page_size, self.kv_dtype, self._axis("tensor")
        )
        frac = self.config.gpu_memory_utilization
        pages = PagedKVCache.pages_from_memory([d.memory_stats() for d in devices], frac, per_page)
        if pages is None:
            log.info("no device memory statistics; %d pages", self.config.default_num_pages)
            return self.config.default_num_pages
        log.info("%d pages of %d bytes from %.2f of the free bytes", pages, per_page, frac)
        return pages

    def _axis(self, name: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[name]

    def _kv_heads_axis(self) -> str | None:
        kv, tp = self.model_config.num_key_value_heads, self._axis("tensor")
        return "tensor" if kv % tp == 0 and tp > 1 else None

    def _pool_spec(self) -> PartitionSpec:
        """A pool's sharding: kv heads over `tensor`, pages by replica over `data` (a stacked
        pool's layer axis whole)."""
        return pool_spec(self.stacked, self._kv_heads_axis(), "data")

    def _replica_spec(self) -> PartitionSpec:
        """A pool's spec in `per_replica` (which names only `data`): pages by replica."""
        return pool_spec(self.stacked, None, "data")

    def _pool_creator(self):
        """The jitted zeros of the KV pools (k, v): one K×(R·N)×S×D array per layer, or one
        stacked L×K×(R·N)×S×D array each for a scanned model (`paged_cache.stacked_layout`).
        Each device holds only its replica's N pages (created in place through
        `out_shardings`, never whole on one device). Built once per engine, so waking after
        `sleep` reuses its compiled program."""
        create = functools.partial(
            PagedKVCache.create_pool,
            self.model_config,
            self.replicas * self.num_pages,
            self.config.page_size,
            self.kv_dtype,
        )
        if self.mesh is None:
            return jax.jit(create)
        return jax.jit(create, out_shardings=NamedSharding(self.mesh, self._pool_spec()))

    def _allocate_pools(self):
        """The zeroed KV pools (k, v) (`_pool_creator`); the one place the engine allocates
        them."""
        return self._create_pools()

    def _constrain_pools(self, pools):
        """Inside a replica's step: its pool keeps its kv heads split over `tensor`."""
        if self.mesh is None:
            return pools
        spec = pool_spec(self.stacked, self._kv_heads_axis())
        return jax.lax.with_sharding_constraint(pools, spec)

    def _upload(self, batch):
        """A row batch (R blocks, `replicas.ROWS_SPEC`) on the devices, block r on replica r."""
        if self.mesh is None:
            return jax.device_put(batch)
        return jax.device_put(batch, NamedSharding(self.mesh, ROWS_SPEC))

    def replica_of(self, slot: int) -> int:
        """The replica that owns `slot` (slots r·max_num_seqs .. (r+1)·max_num_seqs - 1)."""
        return self.scheduler.replica_of(slot)

    def _traced(self, name: str) -> None:
        """Called while tracing: counts (and logs) a compile."""
        self.compile_counts[name] += 1
        log.info("compiling %s (%d compiles so far)", name, self.num_compiles)

    @property
    def num_compiles(self) -> int:
        return sum(self.compile_counts.values())

    # ----------------------------------------------------------------------------- host state

    @property
    def config(self) -> RolloutConfig:
        """The engine's `RolloutConfig`. Setting it also sets the scheduler's (a step's token
        budget and chunking follow it); the sizes of the pools, slots and page books
        (page_size, num_pages, max_num_seqs, page_allocation, watermark) are read once, at
        construction."""
        return self._config

    @config.setter
    def config(self, value: RolloutConfig) -> None:
        self._config = value
        if (scheduler := getattr(self, "scheduler", None)) is not None:  # built after it
            scheduler.config = value

    @property
    def slots(self) -> Slots:
        """Every slot's decode state (`Scheduler.slots`; host numpy)."""
        return self.scheduler.slots

    @slots.setter
    def slots(self, value: Slots) -> None:
        self.scheduler.slots = value

    @property
    def pages(self) -> ReplicaBooks:
        """Each replica's page book and load (`Scheduler.pages`)."""
        return self.scheduler.pages

    @property
    def preempted(self) -> list[Preempted]:
        """Preempted sequences waiting to be recomputed, oldest first."""
        return self.scheduler.preempted

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (rollout/num_preemptions)."""
        return self.scheduler.num_preemptions

    @property
    def _slot_history(self) -> list[list[int]]:
        """Each slot's prompt + tokens after it; empty: the slot is free."""
        return self.scheduler.history

    @property
    def allocators(self):
        """Each replica's `PageAllocator` (free list and reference counts)."""
        return [book.allocator for book in self.pages.books]

    @property
    def num_free_pages(self) -> int:
        """Free pages over every replica's pool."""
        return self.pages.num_free

    def pages_for(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """(pages of the prefilled prompt, pages each sample adds); see `PageBook.pages_for`."""
        return self.pages.books[0].pages_for(prompt_len, params)

    def group_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a prompt's whole group holds at most; see `PageBook.group_pages`."""
        return self.pages.books[0].group_pages(prompt_len, params)

    def check_request(self, request: Request) -> None:
        """Raises ValueError, with the sizes, for a request that can never be served
        (`Scheduler.check_request`)."""
        self.scheduler.check_request(request, len(self.eos_ids))

    def place(self, request: Request) -> int | None:
        """The replica that would take the request's group now (`Scheduler.place`: a slot
        not promised to a waiting sample, pages for the group above the watermark, no
        preempted sequence of its waiting, the least expected tokens), or None."""
        return self.scheduler.place(request)

    def can_prefill(self, request: Request) -> bool:
        """Whether some replica takes the request's group now (`place`)."""
        return self.place(request) is not None

    @property
    def free_slots(self) -> list[int]:
        return [i for i, history in enumerate(self._slot_history) if not history]

    def free_slots_of(self, replica: int) -> list[int]:
        """The free slots of one replica."""
        return self.scheduler.free_slots_of(replica)

    @property
    def num_active(self) -> int:
        return int(self.slots.active.sum())

    # ----------------------------------------------------------------------------- prefill

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

    def admit(self, request: Request) -> Prefix:
        """Places the request's group on a replica (`place`) and books its pages (host only;
        `run_prefill` computes them). Raises ValueError if it can never fit, RuntimeError if
        no replica takes it now (check `can_prefill` first), and RuntimeError before booking
        anything when `sleep(2)` released the weights (booked pages would leak)."""
        self._require_weights("admit")
        self.check_request(request)
        replica = self.place(request)
        if replica is None:
            raise RuntimeError(f"request {request.index}: no replica has room for it now")
        return self.pages.admit(request, replica)

    def prefill(self, requests: list[Request]) -> list[Prefix]:
        """Admits prompts (`admit`) and prefills them (all but their last token) in one call
        (`run_prefill`). Host sync: none (the call is queued)."""
        self._require_weights("prefill")
        self.wake_up()
        prefixes = []
        for r in requests:
            prefixes.append(self.admit(r))
        self.run_prefill(prefixes)
        return prefixes

    def prefill_budgets(self) -> list[int]:
        """Each replica's prompt tokens for this engine step (`Scheduler.prefill_budgets`:
        `max_num_batched_tokens` less its running sequences' tokens of the next decode call)."""
        return self.scheduler.prefill_budgets()

    def run_prefill(self, prefixes: list[Prefix], budget: int | Sequence[int] | None = None) -> int:
        """Computes admitted prompts' keys/values into their pages, every replica's in one
        call (each replica a block of rows, `replicas.per_replica`), and returns the tokens
        computed. Host sync: none.

        `budget` (None: unbounded; one per replica, `prefill_budgets`, or one for every
        replica) caps each replica's tokens of this call: prefixes are taken in order
        (`pages.chunk_sizes`); with `enable_chunked_prefill` the one that would pass the
        budget is computed up to it and continues from there at the next call
        (`Prefix.prefilled`; a later chunk attends to the cached earlier ones,
        `steps.extend`), else it waits whole for the next call (the first one runs whole
        when no decode token of the step spent the budget). Prefixes already prefilled are
        skipped."""
        self._require_weights("run_prefill")
        self.wake_up()  # a sleeping engine's pool comes back with the next rollout
        sizes = self.scheduler.prefill_sizes(prefixes, budget)
        first, rest = [], []  # chunks from position 0 (prefill), later chunks (extend)
        first_of, rest_of = [], []  # their prefixes
        for p, take in zip(prefixes, sizes, strict=True):
            if not take:
                continue
            tokens = p.request.prompt[p.prefilled : p.prefilled + take]
            if p.prefilled == 0:
                first.append((p.replica, tokens, p.pages))
                first_of.append(p)
            else:
                rest.append((p.replica, p.prefilled, tokens, p.pages))
                rest_of.append(p)
            p.prefilled += take
        routed = self._prefill_rows(first) + self._extend_rows(rest)
        for p, chunk in zip(first_of + rest_of, routed, strict=True):
            if chunk is not None:
                p.routing.append(chunk)
        return sum(sizes)

    def _prefill_rows(
        self, rows: list[tuple[int, Sequence[int], list[int]]]
    ) -> list[Routing | None]:
        """Writes the keys/values of (replica, token ids at positions 0.., pages) rows in one
        prefill call, padded to a (batch, length) bucket. Returns, per row, its experts with
        routing replay (`Routing`), else None (and None for a row without tokens).
        Host sync: none."""
        todo = [row for row in rows if len(row[1])]
        if not todo:
            return [None] * len(rows)
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
        self.num_prefill_tokens += int(mask.sum())
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        self.k_pools, self.v_pools, routed = self._prefill_jit(
            self.state,
            self.k_pools,
            self.v_pools,
            *self._upload((flat(ids), flat(mask), flat(table))),
        )
        return self._row_routing(routed, groups, n, rows, lambda row: len(row[1]))

    def _row_routing(self, routed, groups, n: int, rows, length) -> list[Routing | None]:
        """Each of `rows`' share (`Routing`) of a call's experts `routed` (rows of replica r's
        `groups[r]` at r·n + their index), None without routing replay or tokens."""
        if not self.record_routing:
            return [None] * len(rows)
        where = {id(x): r * n + i for r, g in enumerate(groups) for i, x in enumerate(g)}
        return [(routed, where[id(x)], length(x)) if length(x) else None for x in rows]

    # ----------------------------------------------------------------------------- insert

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Puts the prefix's next sample into a free `slot` (host only; the page copy is
        batched into the next `generate` call)."""
        if self._slot_history[slot]:
            raise ValueError(f"slot {slot} is busy")
        if self.replica_of(slot) != prefix.replica:
            raise ValueError(
                f"slot {slot} is on replica {self.replica_of(slot)}, the prefix's pages on "
                f"replica {prefix.replica}"
            )
        if prefix.to_prefill:
            raise ValueError(f"request {prefix.request.index}: prompt not fully prefilled yet")
        r, sample = prefix.request, prefix.next_sample
        pages = self.pages.sample_pages(prefix)  # counts the sample in
        row = first_row(r, sample, self.eos_ids, pages)
        self.scheduler.assign(slot, row, len(r.prompt) + r.params.max_tokens, r.prompt)
        self.scheduler.routing[slot] = list(prefix.routing)

    def free_resource(self, slot: int) -> None:
        """Returns a finished (or abandoned) slot's pages and frees the slot."""
        self.scheduler.release(slot)

    def routing_of(self, slot: int) -> np.ndarray:
        """The experts each fed position of the slot's sequence used in each MoE layer, when
        the engine records them (`enable_rollout_routing_replay`): (prompt + sampled tokens −
        1)×L×k int32, positions from 0 (the last sampled token is never fed). Call it before
        `free_resource`. Raises ValueError when the engine does not record routing.
        Host sync: waits for the calls that computed them."""
        if not self.record_routing:
            raise ValueError("this engine does not record routing (enable_rollout_routing_replay)")
        chunks = [np.asarray(a)[row, :count] for a, row, count in self.scheduler.routing[slot]]
        shape = (0, *(self._routing_shape or ()))
        return np.concatenate(chunks) if chunks else np.zeros(shape, np.int32)

    # ----------------------------------------------------------------------------- preemption

    def recompute_running(self) -> int:
        """Preempts every running sequence, so that `resume` recomputes its keys/values from
        its tokens with the engine's current weights (after `update_weights`: a partial
        rollout continuing under new weights). Its sampling state is kept (`preemption`).
        Returns how many were preempted. Host sync: none (queued page copies run first)."""
        self._flush_pending_copies()
        count = self.scheduler.preempt_running()
        self.scheduler.forget_prefixes()  # no page they held is reused
        return count

    def set_aside(self) -> list[Preempted]:
        """Preempts every running sequence and hands back every preempted one, leaving the
        engine idle (for a rollout in between, e.g. validation); `put_back` queues them again
        for `resume`, which recomputes them with the weights current then. Host sync: none
        (queued page copies run first)."""
        self._flush_pending_copies()
        return self.scheduler.set_aside()

    def put_back(self, sequences: list[Preempted]) -> None:
        """Queues sequences of `set_aside` for `resume` again, oldest first."""
        self.scheduler.put_back(sequences)

    def abort(self, request_indexes: set[int]) -> list[int]:
        """Drops the samples of the given requests: their running slots are freed, their
        preempted sequences forgotten. Returns the freed slots. Host sync: none (queued page
        copies run first)."""
        self._flush_pending_copies()
        return self.scheduler.abort(request_indexes)

    def _flush_pending_copies(self) -> None:
        """Runs the queued copies of partial prompt pages before pages are freed: a copy
        outliving its destination page would overwrite the page's next holder."""
        if self.k_pools is not None:
            self._flush_copies()

    def resume(self) -> list[tuple[int, Preempted]]:
        """Readmits preempted sequences (`Scheduler.readmit`: oldest first, each to a
        replica with a free slot, pages and token budget for it, where the most of its pages
        are cached), their tokens but the last recomputed: from position 0 into fresh pages
        in one prefill call, or, for one that came back on pages still holding its leading
        tokens (the prefix cache), from the first position after them in one extend call.
        Returns (slot, sequence) of each readmitted one. Host sync: none.

        With routing replay every sequence is recomputed from position 0 (its experts are
        recorded per computed position)."""
        if not self.preempted:
            return []
        self._require_weights("resume")
        self.wake_up()
        done = self.scheduler.readmit(share=not self.record_routing)
        ps, pages = self.config.page_size, self.scheduler.slot_pages
        whole = [(slot, seq) for slot, seq, start in done if start == 0]
        rows = [
            (
                self.replica_of(slot),
                seq.tokens[:-1],
                pages[slot][: num_pages(len(seq.tokens) - 1, ps)],
            )
            for slot, seq in whole
        ]
        for (slot, _), chunk in zip(whole, self._prefill_rows(rows), strict=True):
            self.scheduler.routing[slot] = [] if chunk is None else [chunk]
        self._extend_rows(
            [
                (self.replica_of(slot), start, seq.tokens[start:-1], pages[slot])
                for slot, seq, start in done
                if 0 < start < len(seq.tokens) - 1
            ]
        )
        return [(slot, seq) for slot, seq, _ in done]

    # ----------------------------------------------------------------------------- extend

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

    def extend(self, appends: dict[int, tuple[list[int], int]]) -> None:
        """Continues stopped sequences after appended tokens, in one call for every slot.

        `appends` maps a slot that finished (still allocated) to (tokens, max_new): the tokens
        (at least one; e.g. a tool's response) follow the slot's last sampled token, and the
        slot may then sample up to `max_new` more tokens. Its last sampled token and all appended
        tokens but the last are written to its pages at the next positions (only they are
        computed: the cached keys/values of earlier turns are reused); the last appended token
        becomes the slot's next input, so the next sampled token comes out of the decode loop.
        Sampling continues the slot's PRNG stream (token index = tokens sampled so far).

        Raises ValueError for an active or free slot, no tokens, or a sequence that would
        outgrow the pages of its prompt + max_tokens of `insert`; RuntimeError when no page
        is free for the appended tokens and no running sequence can be preempted.
        Host sync: none (the call is queued).
        """
        s, ps = self.slots, self.config.page_size
        for slot, (tokens, max_new) in appends.items():
            if s.active[slot] or not self._slot_history[slot]:
                raise ValueError(f"slot {slot} is not a stopped sequence")
            end = int(s.position[slot]) + len(tokens) + max_new - 1  # last position fed
            limit = num_pages(self.scheduler.slot_tokens[slot] - 1, ps)  # prompt + max_tokens
            if not tokens or max_new < 1 or end >= limit * ps:
                raise ValueError(
                    f"slot {slot}: {len(tokens)} appended tokens + {max_new} new ones from "
                    f"position {int(s.position[slot])} outgrow its {limit} pages of {ps}"
                )
        if not appends:
            return
        self._flush_copies()
        for slot, (tokens, _) in appends.items():  # pages for the fed tokens ("on_demand")
            last = int(s.position[slot]) + len(tokens) - 1
            held = len(self.scheduler.slot_pages[slot])
            if not self.scheduler.ensure_pages(slot, last // ps + 1 - held):
                raise RuntimeError(f"slot {slot}: no KV page free for its appended tokens")
        s = self.slots
        rows = []
        for slot, (tokens, max_new) in appends.items():
            fed = [int(s.token[slot])] + list(tokens[:-1])
            pages = self.scheduler.slot_pages[slot]
            rows.append((self.replica_of(slot), int(s.position[slot]), fed, pages))
            s.token[slot] = tokens[-1]
            s.position[slot] += len(tokens)
            self.scheduler.history[slot] += tokens
            s.max_tokens[slot] = s.num_generated[slot] + max_new
            s.active[slot] = True
        for slot, chunk in zip(appends, self._extend_rows(rows), strict=True):
            if chunk is not None:
                self.scheduler.routing[slot].append(chunk)

    def _extend_rows(
        self, rows: list[tuple[int, int, Sequence[int], list[int]]]
    ) -> list[Routing | None]:
        """Writes the keys/values of (replica, start, token ids at positions start.., pages)
        rows on top of their cached positions 0 .. start-1, in one call padded to a (batch,
        length) bucket (`steps.extend`). Returns their experts as `_prefill_rows` does.
        Host sync: none."""
        if not rows:
            return []
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
        self.num_prefill_tokens += int(mask.sum())
        flat = [x.reshape(-1, *x.shape[2:]) for x in (ids, start, mask, table)]
        self.k_pools, self.v_pools, routed = self._extend_jit(
            self.state, self.k_pools, self.v_pools, *self._upload(flat)
        )
        return self._row_routing(routed, groups, n, rows, lambda row: len(row[2]))

    def _copy_fn(self, k_pools, v_pools, src_C, dst_C):
        self._traced(f"copy_pages{src_C.shape}")
        k, v = copy_pages(k_pools, v_pools, src_C, dst_C)
        return self._constrain_pools(k), self._constrain_pools(v)

    def _flush_copies(self) -> None:
        copies = self.pages.pop_copies()  # per replica, local page numbers
        if not any(copies):
            return
        c = power_of_two_bucket(max(map(len, copies)), 8)
        src = np.zeros((self.replicas, c), np.int32)
        dst = np.full((self.replicas, c), self.num_pages, np.int32)  # padding: dropped
        for r, pairs in enumerate(copies):
            if pairs:
                src[r, : len(pairs)], dst[r, : len(pairs)] = zip(*pairs, strict=True)
        self.k_pools, self.v_pools = self._copy_jit(
            self.k_pools, self.v_pools, *self._upload((src.reshape(-1), dst.reshape(-1)))
        )

    # ----------------------------------------------------------------------------- decode

    def _decode_call(self, state, k_pools, v_pools, batch: Slots, exit_when_done, **static):
        rows, width = batch.page_table.shape
        self._traced(
            f"decode(rows={rows}, steps={static['num_steps']}, filter={static['use_filter']}, "
            f"pages={width})"
        )
        pool, rows_spec, whole = self._replica_spec(), ROWS_SPEC, PartitionSpec()
        fn = per_replica(
            functools.partial(self._decode_fn, **static),
            self.mesh,
            (whole, pool, pool, rows_spec, whole),
            (pool, pool, rows_spec, rows_spec, rows_spec, rows_spec, rows_spec, rows_spec),
        )
        return fn(state, k_pools, v_pools, batch, exit_when_done)

    def _decode_fn(self, state, k_pools, v_pools, batch: Slots, exit_when_done, **static):
        """One replica's decode loop (`steps.decode_loop`); its step count as a 1-vector."""
        loop = functools.partial(
            steps.decode_loop,
            impl=self.impl,
            sliding_window=self.model_config.sliding_window,
            mesh=self.mesh,
            constrain_pools=self._constrain_pools,
            routing_shape=self._routing_shape,
            **static,
        )
        k, v, dyn, n_steps, *out = loop(
            self.graphdef, state, k_pools, v_pools, batch, exit_when_done
        )
        return k, v, dyn, n_steps[None], *out

    def _table_width(self, num_steps: int) -> int:
        """Page-table columns the next `num_steps` steps can touch (`slots.table_width`)."""
        s = self.slots
        last = int(np.max(np.where(s.active, s.position + num_steps - 1, 0)))
        return table_width(last // self.config.page_size + 1, self.config.pages_per_seq)

    def decode_rows(self) -> np.ndarray:
        """The slot of each row of the next decode batch (`slots.replica_rows`: R equal
        blocks, replica r's active slots in slot order, -1 on padding rows)."""
        m = self.config.max_num_seqs
        active = self.slots.active.reshape(self.replicas, m)
        groups = [np.flatnonzero(a) + r * m for r, a in enumerate(active)]
        return replica_rows(groups, m)

    def generate(self, num_steps: int = 1, exit_when_done: int | None = None) -> StepOutput:
        """Runs up to `num_steps` decode steps for every active slot in one jitted loop.

        The active slots are gathered into a decode batch (`decode_rows`); free and finished
        slots cost nothing. The loop stops early when no slot is active, or once
        `exit_when_done` slots finished (default: never early), so the caller can refill them.
        Host sync: waits for the tokens. Slots that finished stay allocated until
        `free_resource`. First each active slot takes the pages the call may write into;
        the slots preempted for lack of them (`StepOutput.preempted`) are free again, their
        sequences queued in `preempted` for `resume`.
        """
        self._flush_copies()  # before pages are freed: a copy's source may be preempted
        preempted = self.scheduler.grow_for_decode(num_steps)
        s = self.slots
        tokens = np.full((s.active.size, num_steps), -1, np.int32)
        log_probs = np.zeros((s.active.size, num_steps), np.float32)
        thresholds = np.full((s.active.size, num_steps), -np.inf, np.float32)
        finished = np.zeros(s.active.size, bool)
        index = self.decode_rows()
        rows = index[index >= 0]
        if not len(rows):
            return StepOutput(tokens, log_probs, finished, finished.copy(), preempted, thresholds)
        filtered = (s.temperature[rows] > 0) & ((s.top_k[rows] > 0) | (s.top_p[rows] < 1))
        use_filter = bool(np.any(filtered))
        size = len(index) // self.replicas  # rows per replica
        limit = np.int32(exit_when_done if exit_when_done is not None else size + 1)
        batch = s.take_rows(index, self._table_width(num_steps))
        static = dict(num_steps=num_steps, use_filter=use_filter)
        upload = self._upload(batch)
        self.k_pools, self.v_pools, dyn, n_steps, out_tok, out_lp, out_thr, out_ex = (
            self._decode_jit(self.state, self.k_pools, self.v_pools, upload, limit, **static)
        )
        dyn, n_steps, out_tok, out_lp, out_thr = jax.device_get(
            (dyn, n_steps, out_tok, out_lp, out_thr)
        )  # sync
        if self.record_routing:  # a row's fed tokens: its first steps, while it was active
            ex = np.asarray(out_ex)
            for i in np.flatnonzero(index >= 0):
                count = int(np.sum(out_tok[i] >= 0))
                self.scheduler.routing[int(index[i])].append((ex, int(i), count))
        self.slots = s.put(index, dict(zip(DYNAMIC_FIELDS, map(np.asarray, dyn), strict=True)))
        self.num_decode_steps += int(np.max(n_steps))
        self.num_decode_rows += int(np.sum(n_steps)) * size
        keep = index >= 0
        tokens[rows], log_probs[rows], thresholds[rows] = out_tok[keep], out_lp[keep], out_thr[keep]
        for slot, new in zip(rows, out_tok[keep], strict=True):
            self.scheduler.history[slot] += new[new >= 0].tolist()
        finished[rows] = ~self.slots.active[rows]  # every row was active
        last = np.where(finished, self.slots.token, -1)
        stopped = finished & np.any(last[:, None] == s.stop_ids, axis=-1) & (last >= 0)
        return StepOutput(tokens, log_probs, finished, stopped, preempted, thresholds)
