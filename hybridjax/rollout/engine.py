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
engine's `scheduler`, which also holds every slot's host state; `hybridjax.rollout.host_state`
is the engine's view of it); the engine runs the jitted calls it plans
(`hybridjax.rollout.programs`, the engine's `programs`), and keeps routing replay's records
(`hybridjax.rollout.routing`).

Multi-turn (`hybridjax.rollout.agent_loop`): a slot that stopped keeps its pages; `extend` appends
tokens (a tool's response) on top of its cached keys/values, computing only the new tokens, and
re-activates it, while the other slots keep decoding.

Device state: the page pools, one per replica (and the weights). Everything else (page tables,
per-slot sampling parameters, positions) lives on the host and is uploaded with each call: a few
KB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybridjax.models.decoder import CausalLM
from hybridjax.models.moe import moe_layers
from hybridjax.platforms import platform_of
from hybridjax.rollout.config import RolloutConfig
from hybridjax.rollout.decode_attention import select_decode_kernel
from hybridjax.rollout.host_state import HostState
from hybridjax.rollout.pages import Prefix, Request
from hybridjax.rollout.preemption import Preempted, recompute_rows
from hybridjax.rollout.programs import Programs, pool_pages
from hybridjax.rollout.routing import Routing, sequence_experts
from hybridjax.rollout.scheduler import Scheduler
from hybridjax.rollout.slots import StepOutput

__all__ = ["Engine", "Prefix", "Request", "StepOutput"]  # re-exported


class Engine(HostState):
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
    logged). The jitted calls are `programs` (`hybridjax.rollout.programs`); the host state of
    every slot and sequence, and the policy over it, is `scheduler`.
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
        impl = select_decode_kernel(
            config.attention_impl,
            model.config.sliding_window,
            platform_of(mesh),
            model.config.resolved_head_dim,
            config.page_size,
        )
        layers = len(moe_layers(model))
        self.record_routing = config.enable_rollout_routing_replay
        if self.record_routing and not layers:
            raise ValueError(
                "rollout.enable_rollout_routing_replay records the experts of a MoE model; "
                "this model is dense"
            )
        routing_shape = (layers, model.config.num_experts_per_tok) if self.record_routing else None
        # the jitted prefill, page-copy, extend and decode calls (`memory.engine_programs`
        # builds the same for compile-only devices, without weights or pools)
        self.programs = Programs(self.graphdef, model.config, config, mesh, impl, routing_shape)
        programs = self.programs  # `stacked`: one array per pool for a scanned model
        self.impl, self.kv_dtype, self.stacked = impl, programs.kv_dtype, programs.stacked
        self.compile_counts, self.replicas = programs.compile_counts, programs.replicas
        self.num_pages = pool_pages(config, model.config, mesh, self.state)  # per replica
        # the host state of every slot and sequence, and the policy over it
        self.scheduler = Scheduler(config, self.replicas, self.num_pages)
        eos = model.config.eos_token_id
        self.eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.num_decode_steps = 0  # decode-loop iterations run so far (all rows in one step)
        self.num_decode_rows = 0  # rows those iterations ran on (padding rows included)
        self.num_prefill_tokens = 0  # tokens run by prefill and extend (padding excluded)
        self.k_pools = self.v_pools = None
        # jitted once: every `wake_up` after a `sleep` runs the same program (no recompile)
        self._create_pools = self.programs.pool_creator(self.num_pages)
        self.wake_up()  # the KV pool (`_allocate_pools`); `sleep` releases it

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
        if self.num_active or any(self.scheduler.history):
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

    def _allocate_pools(self):
        """The zeroed KV pools (k, v) (`Programs.pool_creator`); the one place the engine
        allocates them."""
        return self._create_pools()

    @property
    def num_compiles(self) -> int:
        return self.programs.num_compiles

    # ----------------------------------------------------------------------------- config

    @property
    def config(self) -> RolloutConfig:
        """The engine's `RolloutConfig`. Setting it also sets the scheduler's and the
        programs' (a step's token budget, chunking and prefill buckets follow it); the sizes
        of the pools, slots and page books (page_size, num_pages, max_num_seqs,
        page_allocation, watermark) are read once, at construction."""
        return self._config

    @config.setter
    def config(self, value: RolloutConfig) -> None:
        self._config = value
        for part in ("programs", "scheduler"):  # built after it
            if (built := getattr(self, part, None)) is not None:
                built.config = value

    # ----------------------------------------------------------------------------- prefill

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
        prefill call (`Programs.prefill_rows`). Returns, per row, its experts with routing
        replay (`Routing`), else None. Host sync: none."""
        pools, routed, tokens = self.programs.prefill_rows(
            self.state, (self.k_pools, self.v_pools), rows
        )
        self.k_pools, self.v_pools = pools
        self.num_prefill_tokens += tokens
        return routed

    def _extend_rows(
        self, rows: list[tuple[int, int, Sequence[int], list[int]]]
    ) -> list[Routing | None]:
        """Writes the keys/values of (replica, start, token ids at positions start.., pages)
        rows on top of their cached positions 0 .. start-1, in one call
        (`Programs.extend_rows`). Returns their experts as `_prefill_rows` does.
        Host sync: none."""
        pools, routed, tokens = self.programs.extend_rows(
            self.state, (self.k_pools, self.v_pools), rows
        )
        self.k_pools, self.v_pools = pools
        self.num_prefill_tokens += tokens
        return routed

    def _flush_copies(self) -> None:
        """Runs the queued copies of partial prompt pages (`Programs.copy`)."""
        copies = self.pages.pop_copies()  # per replica, local page numbers
        pools = self.programs.copy((self.k_pools, self.v_pools), copies, self.num_pages)
        self.k_pools, self.v_pools = pools

    # ----------------------------------------------------------------------------- insert

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Puts the prefix's next sample into a free `slot` (host only; the page copy is
        batched into the next `generate` call; `Scheduler.insert`)."""
        self.scheduler.insert(prefix, slot, self.eos_ids)

    def routing_of(self, slot: int) -> np.ndarray:
        """The experts each fed position of the slot's sequence used in each MoE layer, when
        the engine records them (`enable_rollout_routing_replay`): (prompt + sampled tokens −
        1)×L×k int32, positions from 0 (the last sampled token is never fed). Call it before
        `free_resource`. Raises ValueError when the engine does not record routing.
        Host sync: waits for the calls that computed them."""
        if not self.record_routing:
            raise ValueError("this engine does not record routing (enable_rollout_routing_replay)")
        return sequence_experts(self.scheduler.routing[slot], self.programs.routing_shape or ())

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
        m, ps = self.config.max_num_seqs, self.config.page_size
        whole, first, rest = recompute_rows(done, self.scheduler.slot_pages, m, ps)
        for slot, chunk in zip(whole, self._prefill_rows(first), strict=True):
            self.scheduler.routing[slot] = [] if chunk is None else [chunk]
        self._extend_rows(rest)
        return [(slot, seq) for slot, seq, _ in done]

    # ----------------------------------------------------------------------------- extend

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
        self.scheduler.check_extend(appends)
        if not appends:
            return
        self._flush_copies()
        rows = self.scheduler.extend(appends)
        for slot, chunk in zip(appends, self._extend_rows(rows), strict=True):
            if chunk is not None:
                self.scheduler.routing[slot].append(chunk)

    # ----------------------------------------------------------------------------- decode

    def generate(self, num_steps: int = 1, exit_when_done: int | None = None) -> StepOutput:
        """Runs up to `num_steps` decode steps for every active slot in one jitted loop.

        The active slots are gathered into a decode batch (`Slots.decode_rows`); free and
        finished slots cost nothing. The loop stops early when no slot is active, or once
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
        index = s.decode_rows(self.replicas)
        rows = index[index >= 0]
        if not len(rows):
            return StepOutput(tokens, log_probs, finished, finished.copy(), preempted, thresholds)
        filtered = (s.temperature[rows] > 0) & ((s.top_k[rows] > 0) | (s.top_p[rows] < 1))
        use_filter = bool(np.any(filtered))
        size = len(index) // self.replicas  # rows per replica
        limit = np.int32(exit_when_done if exit_when_done is not None else size + 1)
        width = s.table_width(num_steps, self.config.page_size, self.config.pages_per_seq)
        batch = s.take_rows(index, width)
        static = dict(num_steps=num_steps, use_filter=use_filter)
        upload = self.programs.upload(batch)
        self.k_pools, self.v_pools, dyn, n_steps, out_tok, out_lp, out_thr, out_ex = (
            self.programs.decode_jit(
                self.state, self.k_pools, self.v_pools, upload, limit, **static
            )
        )
        dyn, n_steps, out_tok, out_lp, out_thr = jax.device_get(
            (dyn, n_steps, out_tok, out_lp, out_thr)
        )  # sync
        experts = np.asarray(out_ex) if self.record_routing else None
        self.scheduler.record_decode(index, dyn, out_tok, experts)
        self.num_decode_steps += int(np.max(n_steps))
        self.num_decode_rows += int(np.sum(n_steps)) * size
        keep = index >= 0
        tokens[rows], log_probs[rows], thresholds[rows] = out_tok[keep], out_lp[keep], out_thr[keep]
        finished[rows] = ~self.slots.active[rows]  # every row was active
        last = np.where(finished, self.slots.token, -1)
        stopped = finished & np.any(last[:, None] == s.stop_ids, axis=-1) & (last >= 0)
        return StepOutput(tokens, log_probs, finished, stopped, preempted, thresholds)
