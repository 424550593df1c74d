"""The rollout engine: JetStream's surface (`prefill`, `insert`, `generate`, `free_resource`) over
a paged KV cache, with decode slots refilled as sequences finish.

Life of a prompt of length L with n samples:
  1. `prefill`: positions 0 .. L-2 are run once and written to fresh pages (several prompts per
     call, padded to a (batch, length) bucket). Full pages are shared by all n samples; the
     pages of the whole group are reserved (`hybridjax.rollout.pages`).
  2. `insert` (once per sample): a free slot gets the sample's page table and sampling state
     (`hybridjax.rollout.slots`). Its first input is the prompt's last token at position L-1,
     so every sampled token, the first one included, comes out of the decode loop.
  3. `generate`: up to `num_steps` decode steps in one jitted `lax.while_loop` (one host round
     trip; `hybridjax.rollout.steps`) over the ACTIVE slots only: they are gathered into a
     decode batch of a power-of-two size (`decode_batch_size`), so an engine with
     `max_num_seqs` = 256 slots costs what one with as many slots as sequences does.
  4. `free_resource`: the slot's pages go back to the free list.

Multi-turn (`hybridjax.rollout.agent_loop`): a slot that stopped keeps its pages; `extend` appends
tokens (a tool's response) on top of its cached keys/values, computing only the new tokens, and
re-activates it, while the other slots keep decoding.

Device state: the page pools (and the weights). Everything else (page tables, per-slot sampling
parameters, positions) lives on the host and is uploaded with each call: a few KB.
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.models.config import to_dtype
from hybridjax.models.decoder import CausalLM
from hybridjax.rollout import steps
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.paged_cache import PagedKVCache, copy_pages, resolve_attention_impl
from hybridjax.rollout.pages import PageBook, Prefix, Request, num_pages
from hybridjax.rollout.slots import (
    DYNAMIC_FIELDS,
    MAX_STOP_IDS,
    Row,
    Slots,
    StepOutput,
    decode_batch_size,
    power_of_two_bucket,
    prefill_bucket,
)

log = logging.getLogger(__name__)

__all__ = ["Engine", "Prefix", "Request", "StepOutput"]  # re-exported


class Engine:
    """Paged-attention decoder for one `CausalLM` on one (generation) mesh.

    Args:
      model: the actor; its weights are read once (`update_weights` swaps them).
      config: engine sizes (`RolloutConfig`); `max_num_seqs` caps the running sequences.
      mesh: optional generation mesh with axes ("data", "tensor"): decode rows are split over
        `data`, kv heads of the page pool (and the weights' heads/mlp/vocab) over `tensor`. The
        pool's page dimension is replicated over `data`.
      param_shardings: optional shardings of `nnx.state(model)`; by default the rollout rule
        table of `hybridjax.sharding.rules`.

    Compiles: one per prefill bucket (batch, length), one per decode variant (decode batch size:
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
        self.update_weights(state)
        window = model.config.sliding_window
        self.impl = resolve_attention_impl(config.attention_impl, window)
        if self.impl == "pallas" and window is not None:
            raise ValueError("the Pallas paged-attention kernel has no sliding window; use 'jnp'")
        self.kv_dtype = to_dtype(model.config.dtype)
        self.num_pages = self._pool_size()
        self.pages = PageBook(config, self.num_pages)
        eos = model.config.eos_token_id
        self.eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.num_decode_steps = 0  # decode-loop iterations run so far (all rows in one step)
        self.num_decode_rows = 0  # rows those iterations ran on (padding rows included)
        self.num_prefill_tokens = 0  # tokens run by prefill and extend (padding excluded)
        k, v = PagedKVCache.create_pool(
            model.config, self.num_pages, config.page_size, self.kv_dtype
        )
        self.k_pools, self.v_pools = self._place_pools(k), self._place_pools(v)
        self.slots = Slots.empty(config.max_num_seqs, config.pages_per_seq, MAX_STOP_IDS)
        self._slot_pages: list[list[int]] = [[] for _ in range(config.max_num_seqs)]
        self._prefill_jit = jax.jit(self._prefill_fn, donate_argnums=(1, 2))
        self._copy_jit = jax.jit(self._copy_fn, donate_argnums=(0, 1))
        self._extend_jit = jax.jit(self._extend_fn, donate_argnums=(1, 2))
        self._decode_jit = jax.jit(
            self._decode_fn, donate_argnums=(1, 2), static_argnames=("num_steps", "use_filter")
        )

    # ----------------------------------------------------------------------------- set-up

    def update_weights(self, state_or_model: Any) -> None:
        """Swaps in new weights (an `nnx.State` or a module of the same structure); same
        shapes and dtypes mean no recompile. Placed on `param_shardings` when given."""
        state = state_or_model
        if isinstance(state_or_model, nnx.Module):
            state = nnx.state(state_or_model)
        if self._param_shardings is not None:
            state = jax.device_put(state, self._param_shardings)
        self.state = state

    def _pool_size(self) -> int:
        """Pages per layer: explicit, else from free device memory, else the CPU default."""
        if self.config.num_pages:
            return self.config.num_pages
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            log.info("no device memory statistics; %d pages", self.config.default_num_pages)
            return self.config.default_num_pages
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        per_page = PagedKVCache.page_bytes(
            self.model_config, self.config.page_size, self.kv_dtype, self._axis("tensor")
        )
        pages = int(self.config.gpu_memory_utilization * free) // per_page
        frac = self.config.gpu_memory_utilization
        log.info("%d pages of %d bytes from %.2f of %d free bytes", pages, per_page, frac, free)
        return max(pages, 1)

    def _axis(self, name: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[name]

    def _pool_spec(self) -> PartitionSpec:
        kv, tp = self.model_config.num_key_value_heads, self._axis("tensor")
        return PartitionSpec("tensor" if kv % tp == 0 and tp > 1 else None)

    def _place_pools(self, pools):
        if self.mesh is None:
            return pools
        return jax.device_put(pools, NamedSharding(self.mesh, self._pool_spec()))

    def _constrain_pools(self, pools):
        if self.mesh is None:
            return pools
        return jax.lax.with_sharding_constraint(pools, NamedSharding(self.mesh, self._pool_spec()))

    def _upload(self, batch: Slots) -> Slots:
        """The decode batch on the devices: rows split over `data` when they divide evenly."""
        if self.mesh is None:
            return jax.device_put(batch)
        rows, data = batch.token.shape[0], self._axis("data")
        spec = PartitionSpec("data" if rows % data == 0 else None)
        return jax.device_put(batch, NamedSharding(self.mesh, spec))

    def _traced(self, name: str) -> None:
        """Called while tracing: counts (and logs) a compile."""
        self.compile_counts[name] += 1
        log.info("compiling %s (%d compiles so far)", name, self.num_compiles)

    @property
    def num_compiles(self) -> int:
        return sum(self.compile_counts.values())

    # ----------------------------------------------------------------------------- sizes

    @property
    def allocator(self):
        """The pool's `PageAllocator` (free list and reference counts)."""
        return self.pages.allocator

    def pages_for(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """(pages of the prefilled prompt, pages each sample adds); see `PageBook.pages_for`."""
        return self.pages.pages_for(prompt_len, params)

    def group_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a prompt's whole group holds at most; see `PageBook.group_pages`."""
        return self.pages.group_pages(prompt_len, params)

    def check_request(self, request: Request) -> None:
        """Raises ValueError, with the sizes, for a request that can never be served."""
        n_prompt, p = len(request.prompt), request.params
        if n_prompt < 1:
            raise ValueError(f"request {request.index}: empty prompt")
        if n_prompt + p.max_tokens > self.config.max_seq_len:
            raise ValueError(
                f"request {request.index}: prompt of {n_prompt} tokens + max_tokens "
                f"{p.max_tokens} exceeds the engine's max_seq_len {self.config.max_seq_len} "
                f"(rollout.prompt_length {self.config.prompt_length} + response_length "
                f"{self.config.response_length})"
            )
        need = self.group_pages(n_prompt, p)
        if need > self.num_pages:
            raise ValueError(
                f"request {request.index}: needs {need} KV pages (prompt {n_prompt} tokens, "
                f"n={p.n} samples × up to {p.max_tokens} tokens, page_size "
                f"{self.config.page_size}) but the pool has {self.num_pages}; raise "
                "rollout.num_pages / gpu_memory_utilization or lower n / response_length"
            )
        if len(p.stop_token_ids) + len(self.eos_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"request {request.index}: {len(p.stop_token_ids)} stop ids + "
                f"{len(self.eos_ids)} EOS ids exceed {MAX_STOP_IDS}"
            )

    def can_prefill(self, request: Request) -> bool:
        """Whether the free pages (less those promised to waiting samples) hold the group."""
        return self.pages.can_admit(request)

    @property
    def free_slots(self) -> list[int]:
        return [i for i in range(self.config.max_num_seqs) if not self._slot_pages[i]]

    @property
    def num_active(self) -> int:
        return int(self.slots.active.sum())

    # ----------------------------------------------------------------------------- prefill

    def _prefill_fn(self, state, k_pools, v_pools, ids_NxT, mask_NxT, page_table_NxP):
        self._traced(f"prefill{ids_NxT.shape}")
        k, v = steps.prefill(
            self.graphdef,
            state,
            k_pools,
            v_pools,
            ids_NxT,
            mask_NxT,
            page_table_NxP,
            self.model_config.sliding_window,
        )
        return self._constrain_pools(k), self._constrain_pools(v)

    def prefill(self, requests: list[Request]) -> list[Prefix]:
        """Prefills prompts (all but their last token) in one call and reserves their groups'
        pages. Raises ValueError if a request can never fit, RuntimeError if its group does not
        fit now (check `can_prefill` first). Host sync: none (the call is queued)."""
        prefixes = []
        for r in requests:
            self.check_request(r)
            prefixes.append(self.pages.admit(r))
        todo = [p for p in prefixes if len(p.request.prompt) > 1]
        if todo:
            n = prefill_bucket(len(todo))
            t = prefill_bucket(
                max(len(p.request.prompt) - 1 for p in todo), self.config.min_prefill_bucket
            )
            ids = np.zeros((n, t), np.int32)
            mask = np.zeros((n, t), bool)
            table = np.zeros((n, num_pages(t, self.config.page_size)), np.int32)
            for row, p in enumerate(todo):
                length = len(p.request.prompt) - 1
                ids[row, :length] = p.request.prompt[:-1]
                mask[row, :length] = True
                table[row, : len(p.pages)] = p.pages
            self.num_prefill_tokens += int(mask.sum())
            self.k_pools, self.v_pools = self._prefill_jit(
                self.state, self.k_pools, self.v_pools, ids, mask, table
            )
        return prefixes

    # ----------------------------------------------------------------------------- insert

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Puts the prefix's next sample into a free `slot` (host only; the page copy is
        batched into the next `generate` call)."""
        if self._slot_pages[slot]:
            raise ValueError(f"slot {slot} is busy")
        r, p = prefix.request, prefix.request.params
        sample = prefix.next_sample
        pages = self.pages.sample_pages(prefix)
        stop = p.stop_token_ids + (() if p.ignore_eos else self.eos_ids)
        row = Row(
            token=r.prompt[-1],
            position=len(r.prompt) - 1,
            max_tokens=p.max_tokens,
            pages=pages,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=(p.seed & 0x7FFFFFFF, r.index, sample),
            stop_ids=stop,
        )
        self.slots.assign(slot, row)
        self._slot_pages[slot] = pages

    def free_resource(self, slot: int) -> None:
        """Returns a finished (or abandoned) slot's pages and frees the slot."""
        self.pages.release(self._slot_pages[slot])
        self._slot_pages[slot] = []
        self.slots.active[slot] = False

    # ----------------------------------------------------------------------------- extend

    def _extend_fn(self, state, k_pools, v_pools, ids_NxT, start_N, mask_NxT, page_table_NxP):
        self._traced(f"extend{ids_NxT.shape}")
        k, v = steps.extend(
            self.graphdef,
            state,
            k_pools,
            v_pools,
            ids_NxT,
            start_N,
            mask_NxT,
            page_table_NxP,
            self.model_config.sliding_window,
        )
        return self._constrain_pools(k), self._constrain_pools(v)

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
        outgrow the pages the slot holds (its prompt + max_tokens of `insert`).
        Host sync: none (the call is queued).
        """
        s, ps = self.slots, self.config.page_size
        for slot, (tokens, max_new) in appends.items():
            if s.active[slot] or not self._slot_pages[slot]:
                raise ValueError(f"slot {slot} is not a stopped sequence")
            end = int(s.position[slot]) + len(tokens) + max_new - 1  # last position fed
            if not tokens or max_new < 1 or end >= len(self._slot_pages[slot]) * ps:
                raise ValueError(
                    f"slot {slot}: {len(tokens)} appended tokens + {max_new} new ones from "
                    f"position {int(s.position[slot])} outgrow its "
                    f"{len(self._slot_pages[slot])} pages of {ps}"
                )
        if not appends:
            return
        self._flush_copies()
        n = prefill_bucket(len(appends))
        t = prefill_bucket(max(len(v[0]) for v in appends.values()), self.config.min_prefill_bucket)
        ids, mask = np.zeros((n, t), np.int32), np.zeros((n, t), bool)
        start = np.zeros(n, np.int32)
        table = np.zeros((n, self.config.pages_per_seq), np.int32)
        for row, (slot, (tokens, max_new)) in enumerate(appends.items()):
            fed = [int(s.token[slot])] + list(tokens[:-1])
            ids[row, : len(fed)], mask[row, : len(fed)] = fed, True
            start[row], table[row] = s.position[slot], s.page_table[slot]
            s.token[slot] = tokens[-1]
            s.position[slot] += len(tokens)
            s.max_tokens[slot] = s.num_generated[slot] + max_new
            s.active[slot] = True
        self.num_prefill_tokens += int(mask.sum())
        self.k_pools, self.v_pools = self._extend_jit(
            self.state, self.k_pools, self.v_pools, ids, start, mask, table
        )

    def _copy_fn(self, k_pools, v_pools, src_C, dst_C):
        self._traced(f"copy_pages{src_C.shape}")
        k, v = copy_pages(k_pools, v_pools, src_C, dst_C)
        return self._constrain_pools(k), self._constrain_pools(v)

    def _flush_copies(self) -> None:
        copies = self.pages.pop_copies()
        if not copies:
            return
        c = power_of_two_bucket(len(copies), 8)
        src = np.zeros(c, np.int32)
        dst = np.full(c, self.num_pages, np.int32)  # padding: out of bounds, dropped
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.k_pools, self.v_pools = self._copy_jit(self.k_pools, self.v_pools, src, dst)

    # ----------------------------------------------------------------------------- decode

    def _decode_fn(self, state, k_pools, v_pools, batch: Slots, exit_when_done, **static):
        rows, width = batch.page_table.shape
        self._traced(
            f"decode(rows={rows}, steps={static['num_steps']}, filter={static['use_filter']}, "
            f"pages={width})"
        )
        loop = functools.partial(
            steps.decode_loop,
            impl=self.impl,
            sliding_window=self.model_config.sliding_window,
            constrain_pools=self._constrain_pools,
            **static,
        )
        return loop(self.graphdef, state, k_pools, v_pools, batch, exit_when_done)

    def _table_width(self, num_steps: int) -> int:
        """Page-table columns the next `num_steps` steps can touch, rounded up to a quarter of
        the full width: attention gathers only these pages, so early steps of long responses
        do not pay for the full length. At most 4 widths (decode compiles per variant)."""
        s = self.slots
        last = int(np.max(np.where(s.active, s.position + num_steps - 1, 0)))
        step = -(-self.config.pages_per_seq // 4)
        need = last // self.config.page_size + 1
        return min(-(-need // step) * step, self.config.pages_per_seq)

    def decode_rows(self) -> tuple[np.ndarray, int]:
        """(the active slots in slot order, rows of the decode batch that runs them)."""
        rows = np.flatnonzero(self.slots.active)
        size = decode_batch_size(len(rows), self.config.max_num_seqs, self._axis("data"))
        return rows, size

    def generate(self, num_steps: int = 1, exit_when_done: int | None = None) -> StepOutput:
        """Runs up to `num_steps` decode steps for every active slot in one jitted loop.

        The active slots are gathered into a decode batch (`decode_rows`); free and finished
        slots cost nothing. The loop stops early when no slot is active, or once
        `exit_when_done` slots finished (default: never early), so the caller can refill them.
        Host sync: waits for the tokens. Slots that finished stay allocated until
        `free_resource`.
        """
        self._flush_copies()
        s = self.slots
        tokens = np.full((s.active.size, num_steps), -1, np.int32)
        log_probs = np.zeros((s.active.size, num_steps), np.float32)
        finished = np.zeros(s.active.size, bool)
        rows, size = self.decode_rows()
        if not len(rows):
            return StepOutput(tokens, log_probs, finished, finished.copy())
        filtered = (s.temperature[rows] > 0) & ((s.top_k[rows] > 0) | (s.top_p[rows] < 1))
        use_filter = bool(np.any(filtered))
        limit = np.int32(exit_when_done if exit_when_done is not None else size + 1)
        batch = s.take(rows, size, self._table_width(num_steps))
        static = dict(num_steps=num_steps, use_filter=use_filter)
        self.k_pools, self.v_pools, dyn, n_steps, out_tok, out_lp = self._decode_jit(
            self.state, self.k_pools, self.v_pools, self._upload(batch), limit, **static
        )
        dyn, n_steps, out_tok, out_lp = jax.device_get((dyn, n_steps, out_tok, out_lp))  # sync
        self.slots = s.put(rows, dict(zip(DYNAMIC_FIELDS, map(np.asarray, dyn), strict=True)))
        self.num_decode_steps += int(n_steps)
        self.num_decode_rows += int(n_steps) * size
        n = len(rows)
        tokens[rows], log_probs[rows] = out_tok[:n], out_lp[:n]
        finished[rows] = ~self.slots.active[rows]  # every row was active
        last = np.where(finished, self.slots.token, -1)
        stopped = finished & np.any(last[:, None] == s.stop_ids, axis=-1) & (last >= 0)
        return StepOutput(tokens, log_probs, finished, stopped)
