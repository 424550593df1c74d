"""Recompute preemption (vLLM's): what a preempted sequence keeps, and whom to preempt.

With `rollout.page_allocation` = "on_demand" a running sequence takes a KV page when the next
decode call will write into one (`pages_to_grow`). When its replica's pool has none free, the
youngest running sequence of that replica (the highest (request index, sample): the last to
arrive, vLLM's FCFS priority) is preempted: its pages go back to the free list and it waits,
oldest first, ahead of every new prompt. When a replica has a slot and pages for its tokens
again, it is readmitted: prompt + every token fed or sampled so far but the last are computed
again (recomputed, not swapped), the last becomes its next input, and its sampling state
(seed, tokens sampled so far, max_tokens) is unchanged, so its token k still draws number k of
its PRNG stream and its samples are those of a run without preemption.

A preempted sequence comes back on top of the pages that still hold its leading tokens'
keys/values (`hybridjax.rollout.prefix_cache`: its prompt's, held by its siblings or
recomputed by the first of them to come back, and its own while not handed out again), on the
replica that has the most of them, and only its positions after them are recomputed (vLLM's
automatic prefix caching).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from hybridjax.rollout.pages import Request, num_pages
from hybridjax.rollout.prefix_cache import page_digests
from hybridjax.rollout.slots import Row, Slots


@dataclasses.dataclass(frozen=True)
class Preempted:
    """A sequence waiting to be recomputed (host object).

    row: its decode state when preempted (`Row`, pages empty: new ones come on readmission).
    tokens: prompt + every token after it, the next input last (position len(tokens) - 1).
    expected_tokens: its share of its replica's load (prompt + max_tokens).
    replica: the replica it ran on (which admits no new group while it waits).
    digests: the digests of its full pages (`prefix_cache.page_digests(tokens[:-1])`), by
      which it finds them again.
    """

    row: Row
    tokens: tuple[int, ...]
    expected_tokens: int
    replica: int = 0
    digests: tuple[bytes, ...] = ()  # `prefix_cache.page_digests` of tokens[:-1]

    @property
    def request_index(self) -> int:
        return self.row.seed[1]

    @property
    def sample(self) -> int:
        return self.row.seed[2]

    @property
    def priority(self) -> tuple[int, int]:
        """(request index, sample): lower is older, readmitted first, preempted last."""
        return (self.request_index, self.sample)


def first_row(request: Request, sample: int, eos_ids: tuple[int, ...], pages: list[int]) -> Row:
    """The decode state of sample `sample` of `request` when it is inserted (`Engine.insert`):
    its first input is the prompt's last token; `eos_ids` end it unless `ignore_eos`."""
    p = request.params
    return Row(
        token=request.prompt[-1],
        position=len(request.prompt) - 1,
        max_tokens=p.max_tokens,
        pages=pages,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=(p.seed & 0x7FFFFFFF, request.index, sample),
        stop_ids=p.stop_token_ids + (() if p.ignore_eos else eos_ids),
    )


def continuing(
    request: Request, sample: int, generated: list[int], eos_ids: tuple[int, ...], page_size: int
) -> Preempted:
    """Sample `sample` of `request` after it sampled `generated` (not finished), as a preempted
    sequence that `Engine.put_back` queues for readmission: recomputed from its tokens, it
    draws its next token as it would have without the interruption (a partial rollout resumed
    from a checkpoint, `hybridjax.rl.partial_rollout`)."""
    tokens = tuple(request.prompt) + tuple(generated)
    row = dataclasses.replace(
        first_row(request, sample, eos_ids, []),
        token=tokens[-1],
        position=len(tokens) - 1,
        num_generated=len(generated),
    )
    expected = len(request.prompt) + request.params.max_tokens
    return Preempted(row, tokens, expected, 0, tuple(page_digests(tokens[:-1], page_size)))


def row_of(slots: Slots, slot: int) -> Row:
    """The decode state of `slot` as a `Row` (pages left out; host only)."""
    stop = slots.stop_ids[slot]
    return Row(
        token=int(slots.token[slot]),
        position=int(slots.position[slot]),
        max_tokens=int(slots.max_tokens[slot]),
        pages=[],
        temperature=float(slots.temperature[slot]),
        top_k=int(slots.top_k[slot]),
        top_p=float(slots.top_p[slot]),
        seed=tuple(int(x) for x in slots.seed[slot]),  # type: ignore[arg-type]
        stop_ids=tuple(int(x) for x in stop[stop >= 0]),
        num_generated=int(slots.num_generated[slot]),
    )


def priority_of(slots: Slots, slot: int) -> tuple[int, int]:
    """(request index, sample) of the sequence in `slot` (`Preempted.priority`)."""
    return (int(slots.seed[slot, 1]), int(slots.seed[slot, 2]))


def youngest(slots: Slots, candidates: np.ndarray) -> int | None:
    """The active slot among `candidates` (slot indices) with the highest priority tuple (the
    last to arrive: vLLM preempts it first), or None when none is active."""
    active = [int(s) for s in candidates if slots.active[s]]
    return max(active, key=lambda s: priority_of(slots, s)) if active else None


def pages_to_grow(slots: Slots, slot: int, num_steps: int, held: int, page_size: int) -> int:
    """Pages the active `slot` (holding `held` pages) lacks for the positions the next
    `num_steps` decode steps may write: position .. position + min(num_steps, max_tokens -
    num_generated) - 1 (0 when it holds them; vLLM's lookahead slots)."""
    steps = min(num_steps, int(slots.max_tokens[slot] - slots.num_generated[slot]))
    last = int(slots.position[slot]) + max(steps, 1) - 1
    return max(0, last // page_size + 1 - held)


PrefillRow = tuple[int, Sequence[int], list[int]]  # (replica, tokens from position 0, pages)
ExtendRow = tuple[int, int, Sequence[int], list[int]]  # (replica, start, tokens from it, pages)


def recompute_rows(
    done: list[tuple[int, Preempted, int]],
    slot_pages: list[list[int]],
    max_num_seqs: int,
    page_size: int,
) -> tuple[list[int], list[PrefillRow], list[ExtendRow]]:
    """The rows that recompute readmitted sequences (`Scheduler.readmit`: (slot, sequence,
    start) each; slot s on replica s // max_num_seqs, holding `slot_pages[s]`): (the slots of
    those recomputed from position 0, their (replica, tokens, pages) prefill rows, the
    (replica, start, tokens, pages) extend rows of the others that have a position to
    recompute). Every token but the last is recomputed; the last is the next input."""
    whole = [(slot, seq) for slot, seq, start in done if start == 0]
    first: list[PrefillRow] = [
        (
            slot // max_num_seqs,
            seq.tokens[:-1],
            slot_pages[slot][: num_pages(len(seq.tokens) - 1, page_size)],
        )
        for slot, seq in whole
    ]
    rest: list[ExtendRow] = [
        (slot // max_num_seqs, start, seq.tokens[start:-1], slot_pages[slot])
        for slot, seq, start in done
        if 0 < start < len(seq.tokens) - 1
    ]
    return [slot for slot, _ in whole], first, rest
