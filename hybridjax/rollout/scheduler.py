"""The rollout engine's scheduling policy (host only, no device work): which sequences run,
which wait, and the pages and tokens each engine step gives them (vLLM's scheduler and block
manager). `hybridjax.rollout.engine` runs the jitted calls it plans.

An engine step is the host's turn between two decode calls (`batching.fill_slots`, then
`Engine.generate`):
  1. readmission (`readmit`): preempted sequences come back first, oldest first, each to the
     replica with a free slot and pages for its tokens and the next decode call's positions,
     the watermark left free (`pages.PageBook.can_admit_pages`), where the most of its
     leading pages are still cached (`prefix_cache`: only the positions after them are
     recomputed), else the least loaded; its recompute is spent from that replica's token
     budget;
  2. admission (`place`): new groups in order, each to the least loaded replica with a free
     slot and pages for the group, the watermark left free (`replicas.ReplicaBooks.place`),
     and none of its preempted sequences waiting;
  3. the token budget (`prefill_budgets`, `prefill_sizes`): `max_num_batched_tokens` per
     replica, the running sequences' tokens of the next decode call first, then the step's
     recomputes, prompt chunks in what is left (`pages.chunk_sizes`; vLLM V1);
  4. growth (`grow_for_decode`): before the decode call every running sequence, oldest first,
     takes the pages the call may write into; while its replica has none free, the youngest
     sequence there is preempted (`hybridjax.rollout.preemption`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridjax.errors import ConfigError
from hybridjax.rollout import preemption
from hybridjax.rollout.config import RolloutConfig
from hybridjax.rollout.pages import Prefix, Request, chunk_sizes, num_pages
from hybridjax.rollout.preemption import Preempted, first_row
from hybridjax.rollout.prefix_cache import page_digests
from hybridjax.rollout.replicas import ReplicaBooks
from hybridjax.rollout.slots import (
    DYNAMIC_FIELDS,
    MAX_STOP_IDS,
    Row,
    Slots,
    decode_tokens,
)


class Scheduler:
    """The host state of an engine's sequences, and the policy over it.

    Args:
      config: the engine's sizes; `max_num_seqs` slots per replica.
      replicas: R, data-parallel replicas (replica r owns slots r·m .. (r+1)·m - 1).
      num_pages: N, pages of each replica's pool.

    Per slot: its decode state (`slots`), its pages (`slot_pages`), its expected tokens
    (`slot_tokens`: prompt + max_tokens, its share of its replica's load), its `history`
    (prompt + every token fed or sampled after it; empty: the slot is free, while on demand a
    running slot may hold no page yet) and the engine's `routing` chunks of its fed positions
    (opaque here, dropped with the slot).
    """

    def __init__(self, config: RolloutConfig, replicas: int, num_pages: int):
        self.config = config
        self.replicas = replicas
        self.pages = ReplicaBooks(config, replicas, num_pages)
        num_slots = replicas * config.max_num_seqs
        self.slots = Slots.empty(num_slots, config.pages_per_seq, MAX_STOP_IDS)
        self.slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self.slot_tokens = [0] * num_slots
        self.history: list[list[int]] = [[] for _ in range(num_slots)]
        self.routing: list[list[Any]] = [[] for _ in range(num_slots)]
        self.preempted: list[Preempted] = []  # waiting to be recomputed, oldest first
        self.num_preemptions = 0  # sequences preempted so far (rollout/num_preemptions)
        # slots preempted (by `generate` or `extend`) and not refilled since the last `generate`
        self.preempted_slots = np.zeros(num_slots, bool)
        # tokens each replica recomputes for readmitted sequences in this engine step
        self.recomputed = [0] * replicas

    # ----------------------------------------------------------------------------- slots

    def replica_of(self, slot: int) -> int:
        """The replica that owns `slot`."""
        return slot // self.config.max_num_seqs

    def free_slots_of(self, replica: int) -> list[int]:
        """The free slots of one replica, in order."""
        m = self.config.max_num_seqs
        return [i for i in range(replica * m, (replica + 1) * m) if not self.history[i]]

    @property
    def free_slots(self) -> list[int]:
        """Every free slot, in order."""
        return [i for i, history in enumerate(self.history) if not history]

    def _free_counts(self) -> list[int]:
        return [len(self.free_slots_of(r)) for r in range(self.replicas)]

    def assign(self, slot: int, row: Row, tokens: int, history: Sequence[int]) -> None:
        """Runs a sequence in the free `slot`: decode state `row` (its pages included),
        expected `tokens` and `history` (routing starts empty)."""
        self.slots.assign(slot, row)
        self.slot_pages[slot] = list(row.pages)
        self.slot_tokens[slot] = tokens
        self.history[slot] = list(history)
        self.routing[slot] = []
        self.preempted_slots[slot] = False

    def release(self, slot: int) -> None:
        """Returns the slot's pages and expected tokens to its replica and frees the slot."""
        self.pages.release(self.replica_of(slot), self.slot_pages[slot], self.slot_tokens[slot])
        self.slot_pages[slot] = []
        self.slot_tokens[slot] = 0
        self.history[slot] = []
        self.routing[slot] = []
        self.slots.active[slot] = False

    def insert(self, prefix: Prefix, slot: int, eos_ids: tuple[int, ...]) -> None:
        """Runs the prefix's next sample in the free `slot` of the prefix's replica, with its
        prompt's routing chunks (`Engine.insert`). Raises ValueError for a busy slot, one of
        another replica, or a prompt not fully prefilled yet."""
        if self.history[slot]:
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
        row = first_row(r, sample, eos_ids, pages)
        self.assign(slot, row, len(r.prompt) + r.params.max_tokens, r.prompt)
        self.routing[slot] = list(prefix.routing)

    def abort(self, request_indexes: set[int]) -> list[int]:
        """Frees the running slots of the given requests and forgets their preempted
        sequences. Returns the freed slots."""
        busy = [i for i, h in enumerate(self.history) if h]
        slots = [s for s in busy if int(self.slots.seed[s, 1]) in request_indexes]
        for slot in slots:
            self.release(slot)
        self.preempted = [p for p in self.preempted if p.request_index not in request_indexes]
        return slots

    # ----------------------------------------------------------------------------- admission

    def check_request(self, request: Request, num_eos: int) -> None:
        """Raises ValueError, with the sizes, for a request that can never be served: an empty
        prompt, one longer than `max_seq_len` with its max_tokens, a group that cannot fit an
        empty pool with the watermark left free (a `ConfigError`: the pool's sizes), or more
        stop ids (+ `num_eos`) than a slot holds."""
        n_prompt, p, config = len(request.prompt), request.params, self.config
        if n_prompt < 1:
            raise ValueError(f"request {request.index}: empty prompt")
        if n_prompt + p.max_tokens > config.max_seq_len:
            raise ValueError(
                f"request {request.index}: prompt of {n_prompt} tokens + max_tokens "
                f"{p.max_tokens} exceeds the engine's max_seq_len {config.max_seq_len} "
                f"(rollout.prompt_length {config.prompt_length} + response_length "
                f"{config.response_length})"
            )
        book = self.pages.books[0]
        need, total = book.group_pages(n_prompt, p), book.total
        if need + book.watermark > total:  # the pool's sizes: a config error, in one line
            raise ConfigError(
                f"request {request.index}: needs {need} KV pages (prompt {n_prompt} tokens, "
                f"n={p.n} samples × up to {p.max_tokens} tokens, page_size "
                f"{config.page_size}) + a watermark of {book.watermark} but a replica's pool "
                f"has {total}; raise rollout.num_pages / gpu_memory_utilization (or "
                "max_num_seqs, where no memory statistics size the pool) or lower n / "
                "response_length"
            )
        if len(p.stop_token_ids) + num_eos > MAX_STOP_IDS:
            raise ValueError(
                f"request {request.index}: {len(p.stop_token_ids)} stop ids + "
                f"{num_eos} EOS ids exceed {MAX_STOP_IDS}"
            )

    def place(self, request: Request) -> int | None:
        """The replica that takes the request's group now (`ReplicaBooks.place`: a slot not
        promised to a waiting sample, pages for the group above the watermark, the least
        expected tokens), or None. A replica whose preempted sequences wait takes no new
        group (they come back first, as in vLLM, most likely there: their pages are cached
        there)."""
        waiting = {p.replica for p in self.preempted}
        free = [0 if r in waiting else n for r, n in enumerate(self._free_counts())]
        return self.pages.place(request, free)

    def prefill_budgets(self) -> list[int]:
        """Each replica's prompt tokens for this engine step: `max_num_batched_tokens` less
        the tokens its running sequences compute in the next decode call (`slots.
        decode_tokens`; vLLM V1's scheduler: running decodes first) and those it recomputes
        for readmitted sequences in this step, at least 0."""
        s, steps_per_call = self.slots, self.config.decode_steps_per_call
        tokens = decode_tokens(s.active, s.max_tokens - s.num_generated, steps_per_call)
        per_replica = tokens.reshape(self.replicas, -1).sum(axis=1)
        full = self.config.max_num_batched_tokens
        return [
            max(0, full - int(d) - r) for d, r in zip(per_replica, self.recomputed, strict=True)
        ]

    def prefill_sizes(
        self, prefixes: Sequence[Prefix], budget: int | Sequence[int] | None
    ) -> list[int]:
        """Prompt tokens of each prefix to compute in this call, each replica under its own
        budget (None: unbounded; one per replica, `prefill_budgets`; or one for every
        replica), prefixes in order (`pages.chunk_sizes`). Without chunked prefill the first
        may run whole past its replica's budget only when no decode token spent it."""
        sizes = [0] * len(prefixes)
        full, chunked = self.config.max_num_batched_tokens, self.config.enable_chunked_prefill
        for r in range(self.replicas):  # each replica its own budget, as a vLLM engine
            mine = [i for i, p in enumerate(prefixes) if p.replica == r]
            need = [prefixes[i].to_prefill for i in mine]
            if budget is None or isinstance(budget, int):
                total, overrun = sum(need) if budget is None else budget, True
            else:
                total, overrun = budget[r], budget[r] >= full
            for i, take in zip(mine, chunk_sizes(need, total, chunked, overrun), strict=True):
                sizes[i] = take
        return sizes

    def readmit(self, share: bool = True) -> list[tuple[int, Preempted, int]]:
        """Readmits preempted sequences, oldest first, each where it fits now: a replica with a
        free slot (not promised to a waiting sample), pages above the watermark for its tokens
        and the next decode call's positions (so that call cannot preempt it again at once:
        vLLM's lookahead slots), and token budget for its recompute (`prefill_budgets`; the
        first recompute of a replica's engine step always fits, so one longer than the budget
        still comes back). A sequence that fits nowhere waits, and so does the room of the
        replica it ran on: no younger sequence comes back there before it (FCFS per replica,
        as each vLLM engine replica's waiting queue; `place` admits no new group there).

        With `share`, each replica's pages that still hold the sequence's leading full pages'
        keys/values (`PrefixCache.lookup`) count: it goes where the most are cached (the
        least loaded replica on ties, lowest index next), takes them back and recomputes only
        its positions after them; the rest are fresh pages. Each gets its decode state back in
        a free slot. Returns (slot, sequence, start) of each: the caller recomputes
        `tokens[start:-1]` at positions start.., those with start 0 (one prefill call) before
        the others (one extend call), which may sit on pages the former write."""
        done: list[tuple[int, Preempted, int]] = []
        later: list[tuple[int, Preempted]] = []
        held: set[int] = set()  # replicas whose oldest waiting sequence fits nowhere
        for seq in self.preempted:
            readmitted = self._readmit_one(seq, share, held)
            if readmitted is None:
                held.add(seq.replica)
                continue
            slot, start = readmitted
            done.append((slot, seq, start))
            if start == 0:  # its pages, written by the prefill call, serve the extend call
                self._register(slot, seq)
            else:
                later.append((slot, seq))
        for slot, seq in later:  # written by the extend call itself: found by later calls only
            self._register(slot, seq)
        back = {id(seq) for _, seq, _ in done}
        self.preempted = [p for p in self.preempted if id(p) not in back]
        return done

    def _register(self, slot: int, seq: Preempted) -> None:
        """Records the full pages of `slot`, readmitted `seq`, as holding its tokens
        (`PrefixCache.record`)."""
        self.pages.books[self.replica_of(slot)].cache.record(seq.digests, self.slot_pages[slot])

    def _readmit_one(self, seq: Preempted, share: bool, held: set[int]) -> tuple[int, int] | None:
        """Readmits `seq` where it fits now, on no replica in `held` (`readmit`): (slot,
        start), or None."""
        ps = self.config.page_size
        ahead = min(self.config.decode_steps_per_call, seq.row.max_tokens - seq.row.num_generated)
        count = num_pages(len(seq.tokens) - 1 + ahead, ps)
        digests = seq.digests if share else ()
        free, budgets, best = self._free_counts(), self.prefill_budgets(), None
        for replica, book in enumerate(self.pages.books):
            if replica in held:
                continue
            cached = book.cache.find(digests)
            cost = count - len(cached) + book.allocator.num_free_among(cached)
            recompute = len(seq.tokens) - 1 - len(cached) * ps
            over_budget = self.recomputed[replica] and recompute > budgets[replica]
            if over_budget or not self.pages.fits_pages(replica, cost, free):
                continue
            key = (len(cached), -self.pages.load[replica], -replica)
            if best is None or key > best[0]:
                best = (key, replica, cached, recompute)
        if best is None:
            return None
        _, replica, cached, recompute = best
        pages = self.pages.readmit(replica, count - len(cached), seq.expected_tokens, cached)
        slot = self.free_slots_of(replica)[0]
        self.assign(
            slot, dataclasses.replace(seq.row, pages=pages), seq.expected_tokens, seq.tokens
        )
        self.recomputed[replica] += recompute
        return slot, len(cached) * ps

    def forget_prefixes(self) -> None:
        """No preempted sequence comes back on pages computed before now (new weights, or
        the pool released)."""
        for book in self.pages.books:
            book.cache.clear()

    # ----------------------------------------------------------------------------- preemption

    def ensure_pages(self, slot: int, count: int) -> bool:
        """Gives `slot` `count` more pages (`PageBook.grow`), preempting the youngest active
        sequences of its replica while too few are free; False (nothing taken) when the slot
        itself is the youngest, or no other sequence runs there."""
        if count <= 0:
            return True
        replica = self.replica_of(slot)
        m = self.config.max_num_seqs
        while (new := self.pages.books[replica].grow(count)) is None:
            victim = preemption.youngest(self.slots, np.arange(replica * m, (replica + 1) * m))
            if victim is None or victim == slot:
                return False
            self.preempt(victim)
        held = len(self.slot_pages[slot])
        self.slot_pages[slot] += new
        self.slots.page_table[slot, held : held + count] = new
        return True

    def preempt(self, slot: int) -> None:
        """Frees an active slot's pages, their keys/values recorded in its replica's prefix
        cache (`PrefixCache.register`), and queues its sequence for `readmit`."""
        row, replica = preemption.row_of(self.slots, slot), self.replica_of(slot)
        tokens = self.history[slot]
        digests = tuple(page_digests(tokens[:-1], self.config.page_size))
        self.pages.books[replica].cache.record(digests, self.slot_pages[slot])
        seq = Preempted(row, tuple(tokens), self.slot_tokens[slot], replica, digests)
        bisect.insort(self.preempted, seq, key=lambda x: x.priority)
        self.release(slot)
        self.num_preemptions += 1
        self.preempted_slots[slot] = True

    def grow_for_decode(self, num_steps: int) -> np.ndarray:
        """Before a decode call of `num_steps` steps: every active slot, oldest first, takes
        the pages the call may write into; a slot no page can be found for is preempted
        (`ensure_pages`). Returns the slots preempted since the last call and not refilled
        since (by this call or by an `Engine.extend`; bool, one per slot)."""
        active = [int(s) for s in np.flatnonzero(self.slots.active)]
        order = sorted(active, key=lambda s: preemption.priority_of(self.slots, s))
        ps = self.config.page_size
        for slot in order:
            if not self.slots.active[slot]:
                continue  # preempted for an older one
            held = len(self.slot_pages[slot])
            need = preemption.pages_to_grow(self.slots, slot, num_steps, held, ps)
            if not self.ensure_pages(slot, need):
                self.preempt(slot)
        preempted = self.preempted_slots
        self.preempted_slots = np.zeros_like(preempted)
        self.recomputed = [0] * self.replicas  # the engine step ends with this decode call
        return preempted

    def preempt_running(self) -> int:
        """Preempts every running sequence (`Engine.recompute_running`); returns how many."""
        active = np.flatnonzero(self.slots.active)
        for slot in active:
            self.preempt(int(slot))
        return len(active)

    def set_aside(self) -> list[Preempted]:
        """Preempts every running sequence and hands back every preempted one, oldest first,
        leaving nothing running or waiting."""
        self.preempt_running()
        out, self.preempted = self.preempted, []
        self.preempted_slots[:] = False
        return out

    def put_back(self, sequences: list[Preempted]) -> None:
        """Queues sequences of `set_aside` for `readmit` again, oldest first."""
        self.preempted = sorted(self.preempted + sequences, key=lambda x: x.priority)

    # ----------------------------------------------------------------------------- decode, extend

    def record_decode(
        self, index: np.ndarray, dyn: Sequence[Any], tokens: np.ndarray, experts: Any
    ) -> None:
        """After a decode call on the batch whose row i is slot `index[i]` (-1: padding):
        the slots' advanced fields `dyn` (`DYNAMIC_FIELDS`, host arrays), the sampled
        `tokens` (rows × steps, -1 after a row stopped) into their histories, and with routing
        replay (`experts`, the call's N×T×L×k host array, else None) each row's share: its
        first steps, while it was active."""
        rows = np.flatnonzero(index >= 0)
        if experts is not None:
            for i in rows:
                count = int(np.sum(tokens[i] >= 0))
                self.routing[int(index[i])].append((experts, int(i), count))
        self.slots = self.slots.put(
            index, dict(zip(DYNAMIC_FIELDS, map(np.asarray, dyn), strict=True))
        )
        for slot, new in zip(index[rows], tokens[rows], strict=True):
            self.history[slot] += new[new >= 0].tolist()

    def check_extend(self, appends: dict[int, tuple[list[int], int]]) -> None:
        """Raises ValueError, naming the slot, for an `Engine.extend` of an active or free
        slot, no tokens, or a sequence that would outgrow the pages of its prompt + max_tokens
        of `insert`."""
        s, ps = self.slots, self.config.page_size
        for slot, (tokens, max_new) in appends.items():
            if s.active[slot] or not self.history[slot]:
                raise ValueError(f"slot {slot} is not a stopped sequence")
            end = int(s.position[slot]) + len(tokens) + max_new - 1  # last position fed
            limit = num_pages(self.slot_tokens[slot] - 1, ps)  # prompt + max_tokens
            if not tokens or max_new < 1 or end >= limit * ps:
                raise ValueError(
                    f"slot {slot}: {len(tokens)} appended tokens + {max_new} new ones from "
                    f"position {int(s.position[slot])} outgrow its {limit} pages of {ps}"
                )

    def extend(
        self, appends: dict[int, tuple[list[int], int]]
    ) -> list[tuple[int, int, list[int], list[int]]]:
        """Re-activates stopped slots after appended tokens (`check_extend` first): each takes
        the pages its fed tokens need ("on_demand"), its last appended token becomes its next
        input and it may sample `max_new` more. Returns the (replica, start, fed tokens,
        pages) rows to compute: its last sampled token and the appended ones but the last.
        Raises RuntimeError when no page is free for a slot's appended tokens and no running
        sequence can be preempted."""
        ps = self.config.page_size
        for slot, (tokens, _) in appends.items():  # pages for the fed tokens ("on_demand")
            last = int(self.slots.position[slot]) + len(tokens) - 1
            held = len(self.slot_pages[slot])
            if not self.ensure_pages(slot, last // ps + 1 - held):
                raise RuntimeError(f"slot {slot}: no KV page free for its appended tokens")
        s = self.slots
        rows = []
        for slot, (tokens, max_new) in appends.items():
            fed = [int(s.token[slot])] + list(tokens[:-1])
            pages = self.slot_pages[slot]
            rows.append((self.replica_of(slot), int(s.position[slot]), fed, pages))
            s.token[slot] = tokens[-1]
            s.position[slot] += len(tokens)
            self.history[slot] += tokens
            s.max_tokens[slot] = s.num_generated[slot] + max_new
            s.active[slot] = True
        return rows
