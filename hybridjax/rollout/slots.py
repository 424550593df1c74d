"""Host-side decode state: one row per slot of the pool, and the decode batch made of the
active rows only.

`rollout.max_num_seqs` is a cap (as in vLLM), not the decode batch: `Slots` holds that many
rows on the host, but a decode call runs on the active rows alone, gathered into a batch of
`decode_batch_size(active)` rows (a power of two, so a run compiles a few batch sizes whatever
its batch) and scattered back after the call. Rows hold no device state: the KV cache lives in
the page pool, addressed through each row's page table, so any row can run in any batch
position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

MAX_STOP_IDS = 8  # stop ids per request, EOS ids included (width of `Slots.stop_ids`)


def power_of_two_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def prefill_bucket(n: int, minimum: int = 1) -> int:
    """Smallest 2^k or 3·2^(k-1) >= max(n, minimum): at most a third of a prefill is padding
    (a power of two wastes up to half), for twice the compiles."""
    power = power_of_two_bucket(n, minimum)
    three_quarters = 3 * power // 4
    return three_quarters if power >= 4 and three_quarters >= max(n, minimum) else power


def decode_batch_size(num_active: int, max_num_seqs: int, multiple: int = 1) -> int:
    """Rows of the decode batch for `num_active` running sequences: the smallest power of two
    that holds them, at least `multiple` (the mesh's `data` size, so rows split evenly), at most
    `max_num_seqs`. At most log2(max_num_seqs) + 1 sizes, so decode compiles stay bounded;
    padding rows cost at most as much as the active ones."""
    return min(power_of_two_bucket(num_active, multiple), max_num_seqs)


TABLE_WIDTHS = 4  # page-table widths a decode call may take (one compile each)


def table_width(pages_needed: int, pages_per_seq: int) -> int:
    """Page-table columns of a decode call whose rows touch `pages_needed` pages: rounded up to
    a quarter (`TABLE_WIDTHS`) of the full width `pages_per_seq`, so attention gathers only
    these pages (early steps of long responses do not pay for the full length) and a run
    compiles at most 4 widths."""
    step = -(-pages_per_seq // TABLE_WIDTHS)
    return min(-(-pages_needed // step) * step, pages_per_seq)


def table_widths(pages_per_seq: int) -> list[int]:
    """Every width `table_width` returns for a slot of `pages_per_seq` pages (ascending)."""
    return sorted({table_width(n, pages_per_seq) for n in range(1, pages_per_seq + 1)})


def decode_tokens(active: np.ndarray, tokens_left: np.ndarray, num_steps: int) -> np.ndarray:
    """Tokens each slot computes in a decode call of `num_steps` steps: min(num_steps, its
    tokens left to sample) where `active`, else 0 (int, one per slot)."""
    return np.where(active, np.minimum(num_steps, tokens_left), 0)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one `Engine.generate` call produced (host numpy), indexed by slot. B = max_num_seqs,
    K = `num_steps` of the call.

    tokens: B×K int32 (-1 where the slot was inactive or the loop had stopped),
    log_probs: B×K float32 (0 there),
    finished: B bool (slots that finished in this call), stopped: B bool (finished on a stop
    token rather than on max_tokens), preempted: B bool (slots whose sequence was preempted
    since the last call, by this one or by an `Engine.extend`, and not refilled: free now, the
    sequence queued in `Engine.preempted`), thresholds: B×K float32, the support each token
    was sampled from (`sampling.sample_tokens`; −inf: the whole vocabulary, and where
    inactive).
    """

    tokens: np.ndarray
    log_probs: np.ndarray
    finished: np.ndarray
    stopped: np.ndarray
    preempted: np.ndarray
    thresholds: np.ndarray | None = None


# Fields the decode loop advances (returned by it); the others are fixed while a row runs.
DYNAMIC_FIELDS = ("token", "position", "active", "num_generated")


@dataclasses.dataclass(frozen=True)
class Row:
    """One sequence's decode state, written into a slot by `Slots.assign`."""

    token: int  # next input token
    position: int  # its position
    max_tokens: int
    pages: list[int]  # page-table entries, positions 0 .. len·page_size - 1
    temperature: float  # 0: greedy
    top_k: int
    top_p: float
    seed: tuple[int, int, int]  # (params.seed, request index, sample index), int32 lanes
    stop_ids: tuple[int, ...]
    num_generated: int = 0


def _take(x: np.ndarray, index: np.ndarray, fill) -> np.ndarray:
    out = np.full((len(index), *x.shape[1:]), fill, x.dtype)
    out[index >= 0] = x[index[index >= 0]]
    return out


def replica_rows(groups: list[np.ndarray], max_num_seqs: int) -> np.ndarray:
    """The slot of each decode-batch row when replica r runs the slots `groups[r]`: every
    replica gets the same number of rows (a power of two, `decode_batch_size`), replica r's
    block first-come in slot order, -1 on padding rows. R·b int (R = len(groups))."""
    size = decode_batch_size(max(len(g) for g in groups), max_num_seqs)
    index = np.full((len(groups), size), -1, np.int64)
    for r, g in enumerate(groups):
        index[r, : len(g)] = g
    return index.reshape(-1)


# Values of an empty row, where not 0. A padding row of a decode batch is one: inactive, greedy,
# page-table entries 0 (read, never written: writes are masked by `active`).
_EMPTY = dict(top_p=1.0, stop_ids=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Per-slot decode state, B rows (numpy on the host; `take` makes the batch a decode call
    uploads: a few KB)."""

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
    def empty(cls, slots: int, pages_per_seq: int, num_stop: int = MAX_STOP_IDS) -> Slots:
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

    def assign(self, slot: int, row: Row) -> None:
        """Writes `row` into `slot` (in place, host only) and marks it active."""
        if len(row.stop_ids) > self.stop_ids.shape[1]:
            raise ValueError(f"{len(row.stop_ids)} stop ids exceed {self.stop_ids.shape[1]}")
        self.page_table[slot] = 0
        self.page_table[slot, : len(row.pages)] = row.pages
        self.token[slot] = row.token
        self.position[slot] = row.position
        self.active[slot] = True
        self.num_generated[slot] = row.num_generated
        self.max_tokens[slot] = row.max_tokens
        self.temperature[slot] = row.temperature
        self.top_k[slot] = row.top_k
        self.top_p[slot] = row.top_p
        self.seed[slot] = row.seed
        self.stop_ids[slot] = -1
        self.stop_ids[slot, : len(row.stop_ids)] = row.stop_ids

    def take(self, rows: np.ndarray, size: int, width: int) -> Slots:
        """The decode batch: `rows` (slot indices, in this order) followed by empty rows up to
        `size`, page tables cut to their first `width` columns (new host arrays)."""
        index = np.full(size, -1, np.int64)
        index[: len(rows)] = rows
        return self.take_rows(index, width)

    def take_rows(self, index: np.ndarray, width: int) -> Slots:
        """The decode batch whose row i is slot `index[i]` (an empty row where it is -1),
        page tables cut to their first `width` columns (new host arrays)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["page_table"] = fields["page_table"][:, :width]
        return Slots(**{k: _take(v, index, _EMPTY.get(k, 0)) for k, v in fields.items()})

    def decode_rows(self, replicas: int) -> np.ndarray:
        """The slot of each row of the next decode batch (`replica_rows`: R = `replicas`
        equal blocks, replica r's active slots in slot order, -1 on padding rows); replica r
        owns slots r·m .. (r+1)·m - 1, m = B / R."""
        m = self.active.size // replicas
        active = self.active.reshape(replicas, m)
        groups = [np.flatnonzero(a) + r * m for r, a in enumerate(active)]
        return replica_rows(groups, m)

    def table_width(self, num_steps: int, page_size: int, pages_per_seq: int) -> int:
        """Page-table columns the next `num_steps` steps can touch (`table_width`)."""
        last = int(np.max(np.where(self.active, self.position + num_steps - 1, 0)))
        return table_width(last // page_size + 1, pages_per_seq)

    def put(self, index: np.ndarray, batch: dict[str, np.ndarray]) -> Slots:
        """These slots updated from a decode batch's advanced fields (`DYNAMIC_FIELDS`): slot
        `index[i]` from row i (rows where it is -1, and rows past len(index), are skipped)."""
        updates = {}
        keep = index >= 0
        for name, values in batch.items():
            column = getattr(self, name).copy()
            column[index[keep]] = values[: len(index)][keep]
            updates[name] = column
        return dataclasses.replace(self, **updates)
