"""Data-parallel replicas of the rollout engine: each owns its KV pages, its slots and its own
`max_num_seqs` (vLLM's meaning: per engine replica), and a device stores only its replica's
sequences.

Device side (`per_replica`): the engine's jitted steps run inside `jax.shard_map`, manual over
the generation mesh's `data` axis and automatic over `tensor`. A pool is one K×(R·N)×S×D array
per layer with its page dimension split over `data`, so replica r's devices hold its N pages and
see them as an ordinary K×N×S×D pool with local page numbers; row batches (prefill, extend,
decode, page copies) are R equal blocks, block r run by replica r. No step moves a page
between replicas.

Host side (`ReplicaBooks`): a `PageBook` per replica, and the placement of prompts. A prompt's
whole group goes to one replica (its samples share the prompt's pages); among the replicas with
a free slot and room for the group, the one with the fewest expected tokens (prompt + max_tokens
per sample, of the groups it holds) takes it, so replicas stay balanced by expected work.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from hybridjax.rollout.allocator import OutOfPagesError
from hybridjax.rollout.config import RolloutConfig
from hybridjax.rollout.pages import PageBook, Prefix, Request

ROWS_SPEC = PartitionSpec("data")  # R blocks of rows, block r on replica r


def per_replica(fn: Callable, mesh: Mesh | None, in_specs, out_specs) -> Callable:
    """`fn` run by every replica on its own block of each argument (`jax.shard_map` manual
    over `data`, the partitioner still splitting `tensor`); `fn` itself without a mesh.
    Specs name only `data` (the pools' `paged_cache.pool_spec`, ROWS_SPEC, or PartitionSpec()
    for what every replica reads whole: the weights, scalars)."""
    if mesh is None:
        return fn
    return jax.shard_map(
        fn,
        mesh=mesh,
        axis_names=frozenset({"data"}),
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )


def expected_tokens(request: Request) -> int:
    """Tokens a prompt's group may hold: n × (prompt + max_tokens)."""
    return request.params.n * (len(request.prompt) + request.params.max_tokens)


class ReplicaBooks:
    """The page books of R replicas and their load (host bookkeeping, no device work).

    Args:
      config: the engine's sizes; `max_num_seqs` slots per replica.
      replicas: R, the generation mesh's `data` size (1 without a mesh).
      pages: N, pages of each replica's pool.
    """

    def __init__(self, config: RolloutConfig, replicas: int, pages: int):
        self.books = [PageBook(config, pages) for _ in range(replicas)]
        self.load = [0] * replicas  # expected tokens of the groups each replica holds
        self.promised = [0] * replicas  # samples admitted, not yet inserted into a slot

    def __len__(self) -> int:
        return len(self.books)

    def place(self, request: Request, free_slots: list[int]) -> int | None:
        """The replica that takes `request` now: one with a slot not promised to a waiting
        sample (`free_slots[r]` free slots) and pages for the whole group, the least loaded
        first (lowest index on ties); None when no replica has room."""
        return self._place(lambda book: book.can_admit(request), free_slots)

    def fits_pages(self, replica: int, count: int, free_slots: list[int]) -> bool:
        """Whether `replica` has a slot not promised to a waiting sample and `count` pages
        above the watermark (a preempted sequence coming back there)."""
        has_slot = free_slots[replica] > self.promised[replica]
        return has_slot and self.books[replica].can_admit_pages(count)

    def _place(self, fits_in: Callable[[PageBook], bool], free_slots: list[int]) -> int | None:
        fits = [
            r
            for r, book in enumerate(self.books)
            if free_slots[r] > self.promised[r] and fits_in(book)
        ]
        return min(fits, key=lambda r: (self.load[r], r)) if fits else None

    def admit(self, request: Request, replica: int) -> Prefix:
        """Books the group's pages on `replica` (`PageBook.admit`, RuntimeError when they do
        not fit) and counts its load and samples."""
        prefix = self.books[replica].admit(request)
        prefix.replica = replica
        self.load[replica] += expected_tokens(request)
        self.promised[replica] += request.params.n
        return prefix

    def sample_pages(self, prefix: Prefix) -> list[int]:
        """The page table of the prefix's next sample, on its replica (`PageBook.sample_pages`)."""
        self.promised[prefix.replica] -= 1
        return self.books[prefix.replica].sample_pages(prefix)

    def readmit(
        self, replica: int, count: int, tokens: int, shared: list[int] | None = None
    ) -> list[int]:
        """The pages of a preempted sequence coming back to `replica`: the `shared` pages
        that still hold its keys/values there (`PageAllocator.take`), then `count` fresh ones;
        its expected `tokens` counted in the replica's load. Raises OutOfPagesError when the
        fresh pages are not free."""
        book, shared = self.books[replica], list(shared or [])
        book.allocator.take(shared)
        pages = book.grow(count)
        if pages is None:
            book.allocator.release(shared)
            raise OutOfPagesError(f"replica {replica}: {count} pages are not free")
        self.load[replica] += tokens
        return shared + pages

    def release(self, replica: int, pages: list[int], tokens: int) -> None:
        """A finished sample's pages and expected tokens go back to `replica`."""
        self.books[replica].release(pages)
        self.load[replica] -= tokens

    def pop_copies(self) -> list[list[tuple[int, int]]]:
        """Each replica's queued (src, dst) page copies (local page numbers)."""
        return [book.pop_copies() for book in self.books]

    @property
    def num_free(self) -> int:
        """Free pages over every replica."""
        return sum(book.allocator.num_free for book in self.books)
