"""The rollout engine's host-side surface over its scheduler (`Engine` inherits it): views of
every slot's decode state, the page books and the waiting sequences, and the admission queries
`batching` asks before each engine step. Host only, no device work.
"""

from __future__ import annotations

from hybridjax.rollout.pages import Request
from hybridjax.rollout.preemption import Preempted
from hybridjax.rollout.replicas import ReplicaBooks
from hybridjax.rollout.scheduler import Scheduler
from hybridjax.rollout.slots import Slots


class HostState:
    """What an engine's `scheduler` holds and decides, as the engine's API.

    Attributes:
      scheduler: the host state of every slot and sequence, and the policy over it.
      eos_ids: the model's EOS token ids (a request's stop ids are added to them).
    """

    scheduler: Scheduler
    eos_ids: tuple[int, ...]

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
    def allocators(self):
        """Each replica's `PageAllocator` (free list and reference counts)."""
        return [book.allocator for book in self.pages.books]

    @property
    def num_free_pages(self) -> int:
        """Free pages over every replica's pool."""
        return self.pages.num_free

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

    def free_slots_of(self, replica: int) -> list[int]:
        """The free slots of one replica."""
        return self.scheduler.free_slots_of(replica)

    @property
    def num_active(self) -> int:
        """Slots decoding a sequence now, over every replica."""
        return int(self.slots.active.sum())

    def prefill_budgets(self) -> list[int]:
        """Each replica's prompt tokens for this engine step (`Scheduler.prefill_budgets`:
        `max_num_batched_tokens` less its running sequences' tokens of the next decode call)."""
        return self.scheduler.prefill_budgets()

    def free_resource(self, slot: int) -> None:
        """Returns a finished (or abandoned) slot's pages and frees the slot."""
        self.scheduler.release(slot)

    def put_back(self, sequences: list[Preempted]) -> None:
        """Queues sequences of `set_aside` for `resume` again, oldest first."""
        self.scheduler.put_back(sequences)
