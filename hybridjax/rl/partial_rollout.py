"""Partial rollouts (`trainer.partial_rollout`, verl's `async_training.partial_rollout`): the
rollout engine keeps generating across steps, and a step's batch is whatever whole groups have
finished; sequences still running when a batch is handed over carry over to the next one, and
continue under the weights of the next round.

One round per step. Round k adds the prompts of its request (step k+1's batch, and for the
first also step 1's: the queue holds one batch beyond the one being filled, so slots freed by
short responses take new prompts while the long tail runs) to the prompts still in flight,
swaps in the weights the thread was given for step k (`RolloutAhead`, the request made at the
start of step k - lag, lag = min(1, threshold - 1): version max(0, k-1-lag)), and decodes
until `B` groups of `n` samples are finished (the train batch); it then hands over the B
finished groups with the lowest request indices (oldest prompts first) and leaves the others,
finished or not, for the next rounds. No new prompt is admitted once enough groups are
finished, and a round ends only when no admitted prompt waits for slots, so every sample
running at the swap is in a slot.

Weight swap (between rounds, between two engine calls), with `trainer.partial_rollout_kv`
"recompute" (the default): every running sequence is preempted and recomputed from its
tokens (`Engine.recompute_running`, the engine's recompute preemption): its prompt and the
tokens sampled so far are prefilled again with the new weights, its sampling state (seed,
tokens drawn so far) kept. So every token after the swap is sampled from, and its rollout
log-prob is that of, the new policy given the exact prefix, at the price of one prefill of
each running sequence per swap. With "keep" the running sequences keep their pages and go on
decoding under the new weights: no prefill, but the keys and values of the tokens before the
swap are the old weights', so the rollout log-probs after it are the new policy's given a
stale cache; the trainer's π_old is exact, and `algorithm.rollout_is_*` corrects each token by
π_old / π_rollout.

Versions: each response token records the policy version that sampled it (`token_versions`,
B×R int64, -1 past the end). The staleness bound applies per token: at the start of round k
(trained at step k with version k-1), a group holding a token older than
`trainer.staleness_threshold` versions (k-1 - version > threshold) is dropped and generated
again from scratch (same request index and seed) with the current weights.

Rollout correction: the rollout log-probs stay per token, each under its own sampling policy,
so π_old / π_rollout (`algorithm.rollout_is_*`) corrects each token for its own lag.

Checkpoints: at the end of each round the prompts in flight are recorded (`state_after`, a
JSON-ready dict: each group's prompt, data row, sampling parameters, and per sample its tokens,
log-probs, versions and finish reason), and the trainer saves the record of the round of the
step it checkpoints. A resumed run loads it (`load_state`): finished samples wait to be handed
over, samples part-way through go back to the engine as preempted sequences
(`preemption.continuing`: recomputed from their tokens, their PRNG stream where it was), and
groups not yet admitted go back to the queue. With "recompute" the resumed run thus samples
what the uninterrupted run samples after its next weight swap.

Only whole-batch single-turn sampling in one process: multi-turn, a greedy baseline (ReMax)
and several processes are refused (`hybridjax.rl.checks`, `RLTrainer`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from hybridjax.rl.generation import assemble_batch, sampling_params
from hybridjax.rollout import Engine, SamplingParams
from hybridjax.rollout.batching import (
    RolloutOutput,
    drop_preempted,
    fill_slots,
    pad_rows,
    refill_batch,
)
from hybridjax.rollout.pages import Prefix, Request
from hybridjax.rollout.preemption import continuing

log = logging.getLogger(__name__)

KEPT_ROUNDS = 4  # records of the last rounds kept for `state_after` (a save lags by at most 2)


@dataclasses.dataclass
class Group:
    """One prompt's n samples in flight (host object).

    request: what the engine samples (the index is unique in the run).
    prompt: the prompt's row of its data batch (key -> value, as `hybridjax.data` collates).
    tokens, log_probs, versions: per sample, the tokens sampled so far, their rollout
      log-probs and the policy version that sampled each.
    reasons: per sample, "stop" / "length" once finished, else None.
    """

    request: Request
    prompt: dict[str, Any]
    tokens: list[list[int]]
    log_probs: list[list[float]]
    versions: list[list[int]]
    reasons: list[str | None]

    @classmethod
    def fresh(cls, request: Request, prompt: dict[str, Any]) -> Group:
        n = request.params.n
        empty: Callable[[], list[list[Any]]] = lambda: [[] for _ in range(n)]  # noqa: E731
        return cls(request, prompt, empty(), empty(), empty(), [None] * n)

    @property
    def finished(self) -> bool:
        return all(r is not None for r in self.reasons)

    @property
    def oldest(self) -> int | None:
        """The oldest version of its tokens (None before the first token)."""
        return min((min(v) for v in self.versions if v), default=None)


def is_stale(oldest: int | None, step: int, threshold: int) -> bool:
    """Whether a sample whose oldest token has version `oldest` lags step `step`'s weights
    (version step-1) by more than `threshold` versions."""
    return oldest is not None and (step - 1) - oldest > threshold


class PartialRollout:
    """The engine's continuous generation across steps (see the module docstring).

    Args:
      engine: the rollout engine, used only by this object (on the rollout thread).
      rollout: `actor_rollout_ref.rollout` (n and the sampling keys).
      seed: `trainer.seed` (a prompt of step k samples with step k's seed).
      pad_token_id: fills responses past their end.
      sharding: the training mesh's batch axes (where the batch rows go).
      threshold: `trainer.staleness_threshold`, the per-token staleness bound.
    """

    def __init__(
        self,
        engine: Engine,
        rollout: Any,
        seed: int,
        pad_token_id: int,
        sharding: NamedSharding,
        threshold: int,
        kv: str = "recompute",
    ):
        self.engine, self.rollout, self.seed = engine, rollout, seed
        self.pad_token_id, self.sharding, self.threshold = pad_token_id, sharding, threshold
        if kv not in ("recompute", "keep"):
            raise ValueError(f"trainer.partial_rollout_kv={kv!r}; expected 'recompute' or 'keep'")
        self.kv = kv
        self.n = sampling_params(rollout, seed, 0).n
        self.version = 0
        self.groups: dict[int, Group] = {}  # by request index, in flight or finished
        self._queue: collections.deque[Request] = collections.deque()
        self._waiting: collections.deque[Prefix] = collections.deque()
        self._owner: dict[int, int] = {}  # slot -> request index · n + sample
        self._first_row: dict[int, int] = {}  # request index -> its first row key
        self._next_index = 0
        self.num_regenerated = 0  # groups dropped by the staleness bound so far
        self.num_recomputed = 0  # sequences recomputed at weight swaps so far
        self._records: dict[int, dict[str, Any]] = {}  # round -> prompts in flight after it

    def set_weights(self, params: Any, version: int) -> None:
        """Swaps policy `version`'s weights (generation layout) into the engine; running
        sequences are recomputed under them, or keep their keys/values with `kv` "keep"
        (nothing happens if `version` is current)."""
        if version == self.version and self.engine.state is not None:
            return
        self.engine.update_weights(params)
        self.version = version
        if self.kv == "recompute":
            self.num_recomputed += self.engine.recompute_running()

    @contextlib.contextmanager
    def paused(self):
        """Sets the running sequences aside while the engine serves another rollout (e.g.
        validation, which may swap other weights in); on exit this stream's weights come back
        and the sequences are recomputed with them when readmitted."""
        sequences, state = self.engine.set_aside(), self.engine.state
        self._owner.clear()  # every running slot was set aside
        try:
            yield
        finally:
            self.engine.update_weights(state)
            self.engine.put_back(sequences)

    def add(self, prompts: dict[str, Any], step: int) -> None:
        """Queues a data batch's prompts (B rows, `hybridjax.data`'s collated dict) with step
        `step`'s sampling; each gets the next request index."""
        params = sampling_params(self.rollout, self.seed, step)
        ids, mask = np.asarray(prompts["input_ids"]), np.asarray(prompts["attention_mask"])
        for j in range(len(ids)):
            index = self._next_index
            self._next_index += 1
            prompt = tuple(int(t) for t in ids[j][mask[j].astype(bool)])
            request = Request(prompt, params, index)
            self.engine.check_request(request)
            row = {key: value[j] for key, value in prompts.items()}
            self.groups[index] = Group.fresh(request, row)
            self._first_row[index] = index * self.n
            self._queue.append(request)

    def take(self, step: int, count: int) -> tuple[dict[str, Any], RolloutOutput, np.ndarray]:
        """Runs round `step` until `count` groups are finished and hands over the `count`
        oldest: (their prompts as one data batch, their B·n rows, token versions B·n × R
        int64, -1 past the end). Drops and regenerates stale groups first (`is_stale`).
        Raises RuntimeError when fewer than `count` groups are in flight."""
        if len(self.groups) < count:
            raise RuntimeError(f"{len(self.groups)} prompts in flight, {count} needed")
        self._regenerate_stale(step)
        self._decode_until(count)
        done = sorted(i for i, g in self.groups.items() if g.finished)[:count]
        groups = [self.groups.pop(i) for i in done]
        for i in done:
            del self._first_row[i]
        self._records[step] = self._record()
        self._records.pop(step - KEPT_ROUNDS, None)
        return self._assemble(groups)

    def state_after(self, step: int) -> dict[str, Any]:
        """The prompts in flight after round `step` (JSON-ready; for the checkpoint of step
        `step`, see the module docstring). Raises KeyError if that round is not recent."""
        return self._records[step]

    def _record(self) -> dict[str, Any]:
        groups = [
            {
                "index": i,
                "prompt": list(g.request.prompt),
                "params": dataclasses.asdict(g.request.params),
                "row": {key: _to_json(value) for key, value in g.prompt.items()},
                "tokens": [list(t) for t in g.tokens],
                "log_probs": [list(x) for x in g.log_probs],
                "versions": [list(v) for v in g.versions],
                "reasons": list(g.reasons),
            }
            for i, g in sorted(self.groups.items())
        ]
        return {"next_index": self._next_index, "groups": groups}

    def load_state(self, state: dict[str, Any]) -> None:
        """Puts the prompts in flight of a checkpoint (`state_after`) back, on an idle stream:
        finished samples wait to be handed over, started ones are queued in the engine as
        preempted sequences (recomputed with the weights current when they are readmitted),
        groups not yet admitted are queued as new. Groups sampled with other settings than
        this stream's (`rollout.n`, the length, temperature...: the config changed between
        the runs) are queued as new with this stream's, with a warning."""
        if self.groups or self._owner or self.engine.preempted:
            raise RuntimeError("load_state needs a stream with nothing in flight")
        sequences = []
        eos, page_size = self.engine.eos_ids, self.engine.config.page_size
        current = sampling_params(self.rollout, self.seed, 0)
        changed: set[str] = set()  # sampling settings the config changed since the checkpoint
        regenerated = 0
        for g in state["groups"]:
            params = SamplingParams(
                **dict(g["params"], stop_token_ids=tuple(g["params"]["stop_token_ids"]))
            )
            differ = {f.name for f in dataclasses.fields(params) if f.name != "seed"
                      and getattr(params, f.name) != getattr(current, f.name)}  # fmt: skip
            if differ:  # sampled under other settings: generated again under this config's
                changed |= differ
                params = dataclasses.replace(current, seed=params.seed)
            request = Request(tuple(g["prompt"]), params, int(g["index"]))
            row = {key: _from_json(value) for key, value in g["row"].items()}
            group = Group(request, row, g["tokens"], g["log_probs"], g["versions"], g["reasons"])
            if differ:
                self.engine.check_request(request)
                group = Group.fresh(request, row)
                regenerated += 1
            self.groups[request.index] = group
            self._first_row[request.index] = request.index * self.n
            if not any(group.tokens) and not any(r is not None for r in group.reasons):
                self._queue.append(request)
                continue
            sequences += [
                continuing(request, sample, group.tokens[sample], eos, page_size)
                for sample in range(self.n)
                if group.reasons[sample] is None
            ]
        self._next_index = int(state["next_index"])
        self.engine.put_back(sequences)
        if changed:
            log.warning(
                "%d prompts in flight in the checkpoint were sampled with other rollout "
                "settings (%s changed since): they are generated again with this config's",
                regenerated,
                ", ".join(sorted(changed)),
            )

    def batch(self, step: int, count: int):
        """`take`, as the step's (RLBatch, HostColumns) and token versions."""
        prompts, out, versions = self.take(step, count)
        batch, host = assemble_batch(prompts, out, self.n, self.sharding)
        return prompts, batch, host, versions

    def _regenerate_stale(self, step: int) -> None:
        stale = sorted(
            i for i, g in self.groups.items() if is_stale(g.oldest, step, self.threshold)
        )
        if not stale:
            return
        for slot in self.engine.abort(set(stale)):
            del self._owner[slot]
        for i in reversed(stale):  # back to the front of the queue, oldest first
            group = self.groups[i]
            self.groups[i] = Group.fresh(group.request, group.prompt)
            self._queue.appendleft(group.request)
        self.num_regenerated += len(stale)

    def _decode_until(self, count: int) -> None:
        engine, steps = self.engine, self.engine.config.decode_steps_per_call
        while True:
            enough = sum(g.finished for g in self.groups.values()) >= count
            if enough and not self._waiting:
                return
            queue = collections.deque() if enough else self._queue  # admit no more prompts
            fill_slots(engine, queue, self._waiting, self._owner, self._first_row, 0)
            if not self._owner and not any(p.to_prefill for p in self._waiting):
                raise RuntimeError("no request could be admitted; the page pool is too small")
            pending = len(queue) + sum(p.samples_left for p in self._waiting)
            pending += len(engine.preempted)
            exit_when = min(pending, refill_batch(engine)) if pending else 1
            out = engine.generate(steps, exit_when_done=exit_when)
            drop_preempted(out, self._owner)
            for slot, key in list(self._owner.items()):
                index, sample = divmod(key, self.n)
                group = self.groups[index]
                valid = out.tokens[slot] >= 0
                new = out.tokens[slot, valid].tolist()
                group.tokens[sample] += new
                group.log_probs[sample] += out.log_probs[slot, valid].tolist()
                group.versions[sample] += [self.version] * len(new)
                if out.finished[slot]:
                    group.reasons[sample] = "stop" if out.stopped[slot] else "length"
                    engine.free_resource(slot)
                    del self._owner[slot]

    def _assemble(self, groups: list[Group]):
        prompts = {key: _stack([g.prompt[key] for g in groups]) for key in groups[0].prompt}
        rows = [(g, s) for g in groups for s in range(self.n)]
        tokens = [g.tokens[s] for g, s in rows]
        masks = [[1] * len(t) for t in tokens]
        width = max(g.request.params.max_tokens for g in groups)
        responses, mask, log_probs = pad_rows(
            tokens, masks, [g.log_probs[s] for g, s in rows], width, self.pad_token_id
        )
        versions = np.full((len(rows), width), -1, np.int64)
        for i, (g, s) in enumerate(rows):
            versions[i, : len(g.versions[s])] = g.versions[s]
        reasons = tuple(str(g.reasons[s]) for g, s in rows)
        return prompts, RolloutOutput(responses, mask, log_probs, reasons), versions


def _to_json(value: Any) -> Any:
    """A data row's value as JSON (arrays and numpy scalars tagged with their dtype)."""
    if isinstance(value, np.ndarray | np.generic):
        return {"__array__": np.asarray(value).tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    """`_to_json` undone (tuples come back as lists)."""
    if isinstance(value, dict):
        if set(value) == {"__array__", "dtype"}:
            array = np.asarray(value["__array__"], dtype=value["dtype"])
            return array if array.ndim else array[()]
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _stack(values: list) -> np.ndarray | list:
    """Rows of one key of collated batches back into one batch's column."""
    if isinstance(values[0], np.ndarray | np.generic):
        return np.stack(values)
    return list(values)
