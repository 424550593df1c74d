"""The rollout engine: JetStream's surface (`prefill`, `insert`, `generate`, `free_resource`) over
a paged KV cache, with decode slots refilled as sequences finish.

Life of a prompt of length L with n samples:
  1. `prefill`: positions 0 .. L-2 are run once and written to fresh pages (several prompts per
     call, padded to a (batch, length) bucket). Full pages are shared by all n samples.
  2. `insert` (once per sample): a decode slot gets the shared full pages, its own copy of the
     partly filled last page (the last sample to be inserted takes the original, no copy) and
     fresh pages for the response. Its first input is the prompt's last token at position L-1,
     so every sampled token, the first one included, comes out of the decode loop.
  3. `generate`: up to `num_steps` decode steps for every slot inside one jitted
     `lax.while_loop` (one host round trip); the pools are donated (updated in place). The
     sampling noise of all the steps is drawn before the loop, and on the jnp path the slots'
     pages are gathered once into a per-call copy that the steps attend to.
  4. `free_resource`: the slot's pages go back to the free list.

Pages are reserved for a prompt's whole group (n × (L - 1 + max_tokens) positions) when it is
prefilled, so a running sequence never runs out of pages (no preemption, unlike vLLM).
Device state: the page pools (and the weights). Everything else (page tables, per-slot sampling
parameters, positions) lives on the host and is uploaded with each call: a few KB.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridjax.models.config import to_dtype
from hybridjax.models.decoder import CausalLM
from hybridjax.rollout.allocator import PageAllocator
from hybridjax.rollout.config import RolloutConfig, SamplingParams
from hybridjax.rollout.paged_cache import PagedKVCache, copy_pages, resolve_attention_impl
from hybridjax.rollout.sampling import sample_tokens, step_uniforms

log = logging.getLogger(__name__)

MAX_STOP_IDS = 8  # stop ids per request, EOS ids included (width of `Slots.stop_ids`)


def _bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _prefill_bucket(n: int, minimum: int = 1) -> int:
    """Smallest 2^k or 3·2^(k-1) >= max(n, minimum): at most a third of a prefill is padding
    (a power of two wastes up to half), for twice the compiles."""
    power = _bucket(n, minimum)
    three_quarters = 3 * power // 4
    return three_quarters if power >= 4 and three_quarters >= max(n, minimum) else power


def _pages(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to sample: token ids, sampling parameters and its index (folded into the
    PRNG key, so different prompts draw independent noise under one seed)."""

    prompt: tuple[int, ...]
    params: SamplingParams
    index: int = 0


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt, waiting for its samples to be inserted into slots (host object)."""

    request: Request
    shared_pages: list[int]  # full pages of positions 0 .. L-2, shared by every sample
    partial_page: int | None  # the partly filled last prompt page, if any
    next_sample: int = 0

    @property
    def samples_left(self) -> int:
        return self.request.params.n - self.next_sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Per-slot decode state, B = max_num_seqs rows (numpy on the host, uploaded per call)."""

    token: Any  # B int32: next input token
    position: Any  # B int32: its position
    active: Any  # B bool
    num_generated: Any  # B int32
    max_tokens: Any  # B int32
    page_table: Any  # B×P int32
    temperature: Any  # B float32 (0: greedy)
    top_k: Any  # B int32
    top_p: Any  # B float32
    seed: Any  # B×3 int32: (params.seed, request index, sample index)
    stop_ids: Any  # B×S int32, -1 padded

    @classmethod
    def empty(cls, slots: int, pages_per_seq: int, num_stop: int) -> Slots:
        z = lambda *shape, dt=np.int32: np.zeros(shape, dt)
        return cls(
            token=z(slots),
            position=z(slots),
            active=z(slots, dt=bool),
            num_generated=z(slots),
            max_tokens=z(slots),
            page_table=z(slots, pages_per_seq),
            temperature=z(slots, dt=np.float32),
            top_k=z(slots),
            top_p=np.ones(slots, np.float32),
            seed=z(slots, 3),
            stop_ids=np.full((slots, num_stop), -1, np.int32),
        )


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one `generate` call produced (host numpy). K = `num_steps` of the call.

    tokens: B×K int32 (-1 where the slot was inactive or the loop had stopped),
    log_probs: B×K float32 (0 there),
    finished: B bool (slots that finished in this call), stopped: B bool (finished on a stop
    token rather than on max_tokens).
    """

    tokens: np.ndarray
    log_probs: np.ndarray
    finished: np.ndarray
    stopped: np.ndarray


class Engine:
    """Paged-attention decoder for one `CausalLM` on one (generation) mesh.

    Args:
      model: the actor; its weights are read once (`update_weights` swaps them).
      config: engine sizes (`RolloutConfig`).
      mesh: optional generation mesh with axes ("data", "tensor"): slots are split over `data`,
        kv heads of the page pool (and the weights' heads/mlp/vocab) over `tensor`. The pool's
        page dimension is replicated over `data`.
      param_shardings: optional shardings of `nnx.state(model)`; by default the rollout rule
        table of `hybridjax.sharding.rules`.

    Compiles: one per prefill bucket (batch, length), one per (decode steps, top-k/p on/off,
    page-table width: up to 4 widths), one per page-copy bucket; `num_compiles` counts them
    (they are also logged).
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
        self.impl = resolve_attention_impl(config.attention_impl, model.config.sliding_window)
        if self.impl == "pallas" and model.config.sliding_window is not None:
            raise ValueError("the Pallas paged-attention kernel has no sliding window; use 'jnp'")
        self.num_pages = self._pool_size()
        self.allocator = PageAllocator(self.num_pages)
        self.kv_dtype = to_dtype(model.config.dtype)
        eos = model.config.eos_token_id
        self.eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.compile_counts: collections.Counter[str] = collections.Counter()
        self.num_decode_steps = 0  # decode-loop iterations run so far (all slots in one step)
        k, v = PagedKVCache.create_pool(
            model.config, self.num_pages, config.page_size, self.kv_dtype
        )
        self.k_pools, self.v_pools = self._place_pools(k), self._place_pools(v)
        self.slots = Slots.empty(config.max_num_seqs, config.pages_per_seq, MAX_STOP_IDS)
        self._slot_pages: list[list[int]] = [[] for _ in range(config.max_num_seqs)]
        self._reserved = 0  # pages promised to samples of prefilled prompts not yet inserted
        self._copies: list[tuple[int, int]] = []  # (src, dst) page copies due before decoding
        self._prefill_jit = jax.jit(self._prefill_fn, donate_argnums=(1, 2))
        self._copy_jit = jax.jit(self._copy_fn, donate_argnums=(0, 1))
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
        tp = self.mesh.shape["tensor"] if self.mesh is not None else 1
        per_page = PagedKVCache.page_bytes(
            self.model_config, self.config.page_size, to_dtype(self.model_config.dtype), tp
        )
        pages = int(self.config.gpu_memory_utilization * free) // per_page
        frac = self.config.gpu_memory_utilization
        log.info("%d pages of %d bytes from %.2f of %d free bytes", pages, per_page, frac, free)
        return max(pages, 1)

    def _sharding(self, *spec) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec(*spec))

    def _place_pools(self, pools):
        kv, tp = self.model_config.num_key_value_heads, 1
        if self.mesh is not None:
            tp = self.mesh.shape["tensor"]
        sharding = self._sharding("tensor" if kv % tp == 0 and tp > 1 else None)
        return pools if sharding is None else jax.device_put(pools, sharding)

    def _constrain_pools(self, pools):
        if self.mesh is None:
            return pools
        kv, tp = self.model_config.num_key_value_heads, self.mesh.shape["tensor"]
        spec = PartitionSpec("tensor" if kv % tp == 0 and tp > 1 else None)
        return jax.lax.with_sharding_constraint(pools, NamedSharding(self.mesh, spec))

    def _upload_slots(self, slots: Slots) -> Slots:
        if self.mesh is None:
            return jax.device_put(slots)
        data = self.mesh.shape["data"]
        spec = "data" if self.config.max_num_seqs % data == 0 else None
        return jax.device_put(slots, self._sharding(spec))

    def _traced(self, name: str) -> None:
        """Called while tracing: counts (and logs) a compile."""
        self.compile_counts[name] += 1
        log.info("compiling %s (%d compiles so far)", name, self.num_compiles)

    @property
    def num_compiles(self) -> int:
        return sum(self.compile_counts.values())

    # ----------------------------------------------------------------------------- sizes

    def pages_for(self, prompt_len: int, params: SamplingParams) -> tuple[int, int]:
        """(pages of the prefilled prompt, pages each sample adds): the prompt holds positions
        0 .. L-2; a sample holds positions up to L - 2 + max_tokens."""
        ps = self.config.page_size
        prefix = _pages(prompt_len - 1, ps)
        per_sample = _pages(prompt_len - 1 + params.max_tokens, ps) - (prompt_len - 1) // ps
        return prefix, per_sample

    def group_pages(self, prompt_len: int, params: SamplingParams) -> int:
        """Pages a prompt's whole group holds at most (the last sample takes over the partial
        prompt page, so it is counted once)."""
        prefix, per_sample = self.pages_for(prompt_len, params)
        partial = (prompt_len - 1) % self.config.page_size != 0
        return prefix + params.n * per_sample - int(partial)

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
        need = self.group_pages(len(request.prompt), request.params)
        return self.allocator.num_free - self._reserved >= need

    @property
    def free_slots(self) -> list[int]:
        return [i for i in range(self.config.max_num_seqs) if not self._slot_pages[i]]

    @property
    def num_active(self) -> int:
        return int(self.slots.active.sum())

    # ----------------------------------------------------------------------------- prefill

    def _prefill_fn(self, state, k_pools, v_pools, ids_NxT, mask_NxT, page_table_NxP):
        self._traced(f"prefill{ids_NxT.shape}")
        model = nnx.merge(self.graphdef, state)
        positions_NxT = jnp.broadcast_to(jnp.arange(ids_NxT.shape[1]), ids_NxT.shape)
        window = self.model_config.sliding_window
        cache = PagedKVCache(k_pools, v_pools, page_table_NxP, "prefill", sliding_window=window)
        _, cache = model.model(ids_NxT, positions_NxT, mask_NxT, cache)
        return self._constrain_pools(cache.k), self._constrain_pools(cache.v)

    def prefill(self, requests: list[Request]) -> list[Prefix]:
        """Prefills prompts (all but their last token) in one call and reserves their groups'
        pages. Raises ValueError if a request can never fit, RuntimeError if its group does not
        fit now (check `can_prefill` first). Host sync: none (the call is queued)."""
        prefixes = []
        for r in requests:
            self.check_request(r)
            if not self.can_prefill(r):
                raise RuntimeError(f"request {r.index}: not enough free pages now")
            prefix_pages, per_sample = self.pages_for(len(r.prompt), r.params)
            pages = self.allocator.allocate(prefix_pages)
            partial = (len(r.prompt) - 1) % self.config.page_size != 0
            self._reserved += r.params.n * per_sample - int(partial)
            shared, last = (pages[:-1], pages[-1]) if partial else (pages, None)
            prefixes.append(Prefix(r, shared, last))
        todo = [p for p in prefixes if len(p.request.prompt) > 1]
        if todo:
            n = _prefill_bucket(len(todo))
            t = _prefill_bucket(
                max(len(p.request.prompt) - 1 for p in todo), self.config.min_prefill_bucket
            )
            ids = np.zeros((n, t), np.int32)
            mask = np.zeros((n, t), bool)
            table = np.zeros((n, _pages(t, self.config.page_size)), np.int32)
            for row, p in enumerate(todo):
                length = len(p.request.prompt) - 1
                ids[row, :length] = p.request.prompt[:-1]
                mask[row, :length] = True
                pages = p.shared_pages + ([p.partial_page] if p.partial_page is not None else [])
                table[row, : len(pages)] = pages
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
        if prefix.samples_left <= 0:
            raise ValueError(f"request {prefix.request.index}: every sample is already inserted")
        r, p = prefix.request, prefix.request.params
        sample = prefix.next_sample
        prefix.next_sample += 1
        _, per_sample = self.pages_for(len(r.prompt), p)
        self.allocator.share(prefix.shared_pages)
        if prefix.partial_page is None:
            own = self.allocator.allocate(per_sample)
        elif prefix.samples_left == 0:  # last sample: takes over the original partial page
            own = [prefix.partial_page] + self.allocator.allocate(per_sample - 1)
        else:
            own = self.allocator.allocate(per_sample)
            self._copies.append((prefix.partial_page, own[0]))
        self._reserved -= len(own) - int(own[:1] == [prefix.partial_page])
        if prefix.samples_left == 0:
            self.allocator.release(prefix.shared_pages)  # the prefix's own references
        pages = prefix.shared_pages + own
        s = self.slots
        s.page_table[slot] = 0
        s.page_table[slot, : len(pages)] = pages
        s.token[slot] = r.prompt[-1]
        s.position[slot] = len(r.prompt) - 1
        s.active[slot] = True
        s.num_generated[slot] = 0
        s.max_tokens[slot] = p.max_tokens
        s.temperature[slot] = p.temperature
        s.top_k[slot] = p.top_k
        s.top_p[slot] = p.top_p
        s.seed[slot] = (p.seed & 0x7FFFFFFF, r.index, sample)  # int32 lanes
        stop = p.stop_token_ids + (() if p.ignore_eos else self.eos_ids)
        s.stop_ids[slot] = -1
        s.stop_ids[slot, : len(stop)] = stop
        self._slot_pages[slot] = pages

    def free_resource(self, slot: int) -> None:
        """Returns a finished (or abandoned) slot's pages and frees the slot."""
        self.allocator.release(self._slot_pages[slot])
        self._slot_pages[slot] = []
        self.slots.active[slot] = False

    def _copy_fn(self, k_pools, v_pools, src_C, dst_C):
        self._traced(f"copy_pages{src_C.shape}")
        k, v = copy_pages(k_pools, v_pools, src_C, dst_C)
        return self._constrain_pools(k), self._constrain_pools(v)

    def _flush_copies(self) -> None:
        if not self._copies:
            return
        c = _bucket(len(self._copies), 8)
        src = np.zeros(c, np.int32)
        dst = np.full(c, self.num_pages, np.int32)  # padding: out of bounds, dropped
        src[: len(self._copies)], dst[: len(self._copies)] = zip(*self._copies, strict=True)
        self.k_pools, self.v_pools = self._copy_jit(self.k_pools, self.v_pools, src, dst)
        self._copies = []

    # ----------------------------------------------------------------------------- decode

    def _decode_fn(
        self, state, k_pools, v_pools, slots: Slots, exit_when_done, *, num_steps, use_filter
    ):
        width = slots.page_table.shape[1]
        self._traced(f"decode(steps={num_steps}, filter={use_filter}, pages={width})")
        b = slots.token.shape[0]
        base_keys = jax.vmap(
            lambda s: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s[0]), s[1]), s[2])
        )(slots.seed)
        # Active slots generate one token per step: step i draws token num_generated + i.
        uniform_BxK = step_uniforms(base_keys, slots.num_generated, num_steps)

        def cond(carry):
            i, _, _, _, active, _, _, _, done = carry
            return (i < num_steps) & jnp.any(active) & (done < exit_when_done)

        def body(carry):
            i, cache, token, position, active, n_gen, out_tok, out_lp, done = carry
            model = nnx.merge(self.graphdef, state)
            logits, cache = model.decode(token[:, None], position[:, None], active[:, None], cache)
            new_tok, lp = sample_tokens(
                logits[:, 0],
                uniform_BxK[:, i],
                slots.temperature,
                slots.top_k,
                slots.top_p,
                use_filter,
            )
            out_tok = out_tok.at[:, i].set(jnp.where(active, new_tok, -1))
            out_lp = out_lp.at[:, i].set(jnp.where(active, lp, 0.0))
            n_gen = n_gen + active
            stop = jnp.any(new_tok[:, None] == slots.stop_ids, axis=-1)
            finish = active & (stop | (n_gen >= slots.max_tokens))
            position = position + active
            token = jnp.where(active, new_tok, token)
            active = active & ~finish
            cache = dataclasses.replace(
                cache, k=self._constrain_pools(cache.k), v=self._constrain_pools(cache.v)
            )
            return (
                i + 1,
                cache,
                token,
                position,
                active,
                n_gen,
                out_tok,
                out_lp,
                done + finish.sum(),
            )

        window = self.model_config.sliding_window
        cache = PagedKVCache(k_pools, v_pools, slots.page_table, "decode", self.impl, window)
        if self.impl == "jnp":
            cache = cache.gathered()  # once per call; the steps keep the copy up to date
        out_tok = jnp.full((b, num_steps), -1, jnp.int32)
        out_lp = jnp.zeros((b, num_steps), jnp.float32)
        dynamic = (slots.token, slots.position, slots.active, slots.num_generated)
        carry = (0, cache, *dynamic, out_tok, out_lp, jnp.int32(0))
        steps, cache, token, position, active, n_gen, out_tok, out_lp, _ = jax.lax.while_loop(
            cond, body, carry
        )
        return cache.k, cache.v, (token, position, active, n_gen, steps), out_tok, out_lp

    def _table_width(self, num_steps: int) -> int:
        """Page-table columns the next `num_steps` steps can touch, rounded up to a quarter of
        the full width: attention gathers only these pages, so early steps of long responses
        do not pay for the full length. At most 4 widths (decode compiles per variant)."""
        s = self.slots
        last = int(np.max(np.where(s.active, s.position + num_steps - 1, 0)))
        step = -(-self.config.pages_per_seq // 4)
        need = last // self.config.page_size + 1
        return min(-(-need // step) * step, self.config.pages_per_seq)

    def generate(self, num_steps: int = 1, exit_when_done: int | None = None) -> StepOutput:
        """Runs up to `num_steps` decode steps for every active slot in one jitted loop.

        The loop stops early when no slot is active, or once `exit_when_done` slots finished
        (default: never early), so the caller can refill them. Host sync: waits for the
        tokens. Slots that finished stay allocated until `free_resource`.
        """
        self._flush_copies()
        s = self.slots
        use_filter = bool(np.any((s.temperature > 0) & s.active & ((s.top_k > 0) | (s.top_p < 1))))
        was_active = s.active.copy()
        limit = np.int32(exit_when_done if exit_when_done is not None else s.active.size + 1)
        upload = dataclasses.replace(s, page_table=s.page_table[:, : self._table_width(num_steps)])
        static = dict(num_steps=num_steps, use_filter=use_filter)
        self.k_pools, self.v_pools, dyn, out_tok, out_lp = self._decode_jit(
            self.state, self.k_pools, self.v_pools, self._upload_slots(upload), limit, **static
        )
        token, position, active, n_gen, steps, out_tok, out_lp = (
            np.array(x) for x in jax.device_get((*dyn, out_tok, out_lp))
        )  # host sync
        self.slots = dataclasses.replace(
            s, token=token, position=position, active=active, num_generated=n_gen
        )
        self.num_decode_steps += int(steps)
        finished = was_active & ~active
        last = np.where(finished, token, -1)
        stopped = finished & np.any(last[:, None] == s.stop_ids, axis=-1) & (last >= 0)
        return StepOutput(out_tok, out_lp, finished, stopped)
