"""The trainer's entry point: `generate(engine, prompt_ids, sampling_params) -> RolloutOutput`.

Continuous batching: requests wait in a queue; whenever slots are free (and the pool holds the
prompt's group) prompts are prefilled, several per call, and their samples inserted; the decode
loop returns to the host after `decode_steps_per_call` steps or as soon as enough slots finished
to refill them. `continuous=False` runs the same engine as static batches (refill only once every
slot finished), the baseline of the benchmark.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from hybridjax.rollout.config import SamplingParams
from hybridjax.rollout.engine import Engine
from hybridjax.rollout.pages import Prefix, Request

# The decode loop returns to the host (to refill slots) once max_num_seqs / REFILL_DIVISOR slots
# have finished (at least one). Each refill costs a round trip, a decode loop's page gather and
# a prefill call of its own (small prefills pad more); an idle slot costs a step's share. With
# response lengths spread over 8 .. 128 on 32 slots, refilling 4 at a time was fastest.
REFILL_DIVISOR = 8


@dataclasses.dataclass(frozen=True)
class RolloutOutput:
    """Responses of a batch, the `n` samples of each prompt contiguous (row = prompt·n + sample).

    responses: (B·n)×R int32, right-padded with `pad_token_id`; R = max max_tokens.
    response_mask: (B·n)×R int32, 1 on generated tokens (the stop token included).
    rollout_log_probs: (B·n)×R float32, log-prob of each token under the distribution it was
      sampled from (see `hybridjax.rollout.sampling`), 0 on padding.
    finish_reason: per row, "stop" (EOS or a stop id) or "length" (max_tokens).
    routed_experts: with rollout routing replay (`Engine.record_routing`), per row the experts
      each fed token used in each MoE layer (`Engine.routing_of`: (prompt + response −
      1)×L×k int32, from the prompt's first token), else None.
    rollout_logit_threshold: (B·n)×R float32, the support each token was sampled from
      (`hybridjax.rollout.sampling`: kept = logits / T ≥ it; −inf: the whole vocabulary, and
      on padding), or None when the rollout did not record it.
    """

    responses: np.ndarray
    response_mask: np.ndarray
    rollout_log_probs: np.ndarray
    finish_reason: tuple[str, ...]
    routed_experts: tuple[np.ndarray, ...] | None = None
    rollout_logit_threshold: np.ndarray | None = None


def _prompts(prompt_ids, attention_mask) -> list[tuple[int, ...]]:
    """Token-id tuples from a list of lists or a (left-)padded B×T array with its mask."""
    if isinstance(prompt_ids, np.ndarray) or hasattr(prompt_ids, "shape"):
        ids = np.asarray(prompt_ids)
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask)
        return [
            tuple(int(t) for t in row[m.astype(bool)]) for row, m in zip(ids, mask, strict=True)
        ]
    return [tuple(int(t) for t in p) for p in prompt_ids]


def generate(
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    sampling_params: SamplingParams | Sequence[SamplingParams],
    attention_mask: np.ndarray | None = None,
    pad_token_id: int = 0,
    continuous: bool = True,
    first_index: int = 0,
) -> RolloutOutput:
    """Samples `n` responses per prompt with continuous batching.

    Args:
      engine: an idle `Engine` (no active slots); it is idle again on return, every page free.
      prompt_ids: list of token-id lists, or a B×T array (left padding allowed) with
        `attention_mask` (1 on tokens; None: every position is a token).
      sampling_params: one for all prompts or one per prompt (prompt j uses request index j).
      pad_token_id: fills responses past their end.
      continuous: False refills only when every slot finished (static batching).
      first_index: request index of the first prompt (prompt j draws its noise as request
        `first_index + j`: a share of a larger batch samples as it would within the batch).
    Raises:
      ValueError: a prompt can never be served (too long, or its group needs more pages than
        the pool has), before any work is done.
    """
    requests = make_requests(engine, prompt_ids, sampling_params, attention_mask, first_index)
    first_row = np.cumsum([0] + [r.params.n for r in requests])
    width = max((r.params.max_tokens for r in requests), default=1)
    tokens: list[list[int]] = [[] for _ in range(first_row[-1])]
    log_probs: list[list[float]] = [[] for _ in range(first_row[-1])]
    thresholds: list[list[float]] = [[] for _ in range(first_row[-1])]
    reasons = ["length"] * int(first_row[-1])
    routing: list[np.ndarray] = [np.zeros(0)] * int(first_row[-1])
    queue = collections.deque(requests)
    waiting: collections.deque[Prefix] = collections.deque()
    owner: dict[int, int] = {}  # slot -> output row
    steps = engine.config.decode_steps_per_call

    while queue or waiting or owner or engine.preempted:
        if continuous or not owner:
            fill_slots(engine, queue, waiting, owner, first_row, first_index)
        if not owner and not any(p.to_prefill for p in waiting):
            raise RuntimeError("no request could be admitted; the page pool is too small")
        pending = len(queue) + sum(p.samples_left for p in waiting) + len(engine.preempted)
        exit_when = min(pending, refill_batch(engine)) if (continuous and pending) else None
        out = engine.generate(steps, exit_when_done=exit_when)
        drop_preempted(out, owner)
        for slot, row in list(owner.items()):
            valid = out.tokens[slot] >= 0
            tokens[row].extend(out.tokens[slot, valid].tolist())
            log_probs[row].extend(out.log_probs[slot, valid].tolist())
            if out.thresholds is not None:
                thresholds[row].extend(out.thresholds[slot, valid].tolist())
            if out.finished[slot]:
                reasons[row] = "stop" if out.stopped[slot] else "length"
                if engine.record_routing:
                    routing[row] = engine.routing_of(slot)
                engine.free_resource(slot)
                del owner[slot]

    masks = [[1] * len(t) for t in tokens]
    routed = tuple(routing) if engine.record_routing else None
    padded = pad_rows(tokens, masks, log_probs, width, pad_token_id)
    threshold = np.full(padded[2].shape, -np.inf, np.float32)
    for i, row in enumerate(thresholds):
        threshold[i, : len(row)] = row
    return RolloutOutput(*padded, tuple(reasons), routed, threshold)


def make_requests(
    engine: Engine, prompt_ids, sampling_params, attention_mask, first_index: int
) -> list[Request]:
    """One `Request` per prompt (see `generate`), each checked against the engine; raises
    ValueError for one that can never be served, RuntimeError if the engine is busy."""
    prompts = _prompts(prompt_ids, attention_mask)
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
    requests = [
        Request(p, sp, first_index + j)
        for j, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True))
    ]
    for r in requests:
        engine.check_request(r)
    if engine.num_active:
        raise RuntimeError("generate() needs an idle engine")
    return requests


def refill_batch(engine: Engine) -> int:
    """Finished slots after which the decode loop returns to refill them."""
    return max(1, engine.config.max_num_seqs // REFILL_DIVISOR)


def fill_slots(engine, queue, waiting, owner, first_row, first_index: int) -> list[int]:
    """Readmits preempted sequences first (`Engine.resume`, oldest first, as vLLM), then admits
    queued requests in order while a replica none of whose preempted sequences waits has a free
    slot and pages for the group (`Engine.place`), prefills them in one call, and inserts
    waiting samples into free slots of their prompt's replica; `owner` maps each filled slot
    to its output row (`first_row[request] + sample`). Returns the slots of the samples
    inserted (not those readmitted).

    Prefill spends what `rollout.max_num_batched_tokens` leaves after the running sequences'
    tokens of the next decode call, per replica (`Engine.prefill_budgets`), prompts in
    admission order (`Engine.run_prefill`): a prompt is admitted only while the replicas'
    budgets are not spent, and one that is not fully prefilled gets no slot until a later call
    finishes it."""
    for slot, seq in engine.resume():
        owner[slot] = first_row[seq.request_index - first_index] + seq.sample
    budgets = engine.prefill_budgets()  # the resumed sequences decode in the next call too
    due = sum(p.to_prefill for p in waiting)
    room = sum(budgets)
    while queue and due < room and engine.can_prefill(queue[0]):
        prefix = engine.admit(queue.popleft())
        waiting.append(prefix)
        due += prefix.to_prefill
    engine.run_prefill([p for p in waiting if p.to_prefill], budgets)
    inserted = []
    for prefix in [p for p in waiting if not p.to_prefill]:
        for slot in engine.free_slots_of(prefix.replica)[: prefix.samples_left]:
            owner[slot] = first_row[prefix.request.index - first_index] + prefix.next_sample
            engine.insert(prefix, slot)
            inserted.append(slot)
        if prefix.samples_left == 0:
            waiting.remove(prefix)
    return inserted


def drop_preempted(out, owner: dict[int, int]) -> None:
    """Forgets the slots preempted by the last `Engine.generate` call (`StepOutput.preempted`):
    their sequences come back, in other slots, through `fill_slots`; their output rows keep
    the tokens they have."""
    for slot in np.flatnonzero(out.preempted):
        del owner[int(slot)]


def pad_rows(
    tokens, masks, log_probs, width: int, pad_token_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(responses int32, response_mask int32, log-probs float32), each rows×width, from
    per-row lists (right-padded with `pad_token_id`, 0 and 0)."""
    rows = len(tokens)
    responses = np.full((rows, width), pad_token_id, np.int32)
    mask = np.zeros((rows, width), np.int32)
    lps = np.zeros((rows, width), np.float32)
    for i, (t, m, lp) in enumerate(zip(tokens, masks, log_probs, strict=True)):
        responses[i, : len(t)], mask[i, : len(m)], lps[i, : len(lp)] = t, m, lp
    return responses, mask, lps


def generate_after_prefixes(
    engine: Engine,
    prefixes: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[Sequence[int]]],
    params: SamplingParams,
    first_index: int = 0,
) -> list[list[int]]:
    """Samples one completion of each `prefix + continuation`, a prefix's KV pages computed
    once for all its continuations (a judge's template head and prompt, shared by the
    prompt's n responses).

    Prefix j is one request with `n = len(continuations[j])` samples: its full pages are
    prefilled once and shared (as the n samples of a rollout prompt); each sample's slot then
    `extend`s its own continuation (only those tokens are computed) and samples at most
    `params.max_tokens` tokens. Continuous batching: a prefix's group is admitted when a replica
    has the slots and pages, samples are inserted as slots free up.

    Args:
      engine: an idle `Engine`; its `response_length` must hold the longest continuation plus
        `params.max_tokens` (its `prompt_length` the longest prefix).
      prefixes: token ids, each at least one token.
      continuations: per prefix, the token-id continuations (one output row each; an empty
        one samples right after the prefix).
      params: `n` is ignored (one completion per continuation).

    Returns:
      The sampled ids of each row (stop token included), in the order of `continuations`
      flattened.

    Raises:
      ValueError: a prefix is empty, or a group can never be served (as `generate`).
    """
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("every prefix needs at least one token")
    longest = [max((len(c) for c in group), default=0) for group in continuations]
    requests = [
        Request(
            tuple(p),
            dataclasses.replace(params, n=len(g), max_tokens=params.max_tokens + extra),
            first_index + j,
        )
        for j, (p, g, extra) in enumerate(zip(prefixes, continuations, longest, strict=True))
        if g
    ]
    for r in requests:
        engine.check_request(r)
    if engine.num_active:
        raise RuntimeError("generate_after_prefixes() needs an idle engine")
    first_row = np.cumsum([0] + [len(g) for g in continuations])
    tokens: list[list[int]] = [[] for _ in range(first_row[-1])]
    queue = collections.deque(requests)
    waiting: collections.deque[Prefix] = collections.deque()
    owner: dict[int, int] = {}
    rows_of = {r.index: first_row[r.index - first_index] for r in requests}
    conts = [c for group in continuations for c in group]
    while queue or waiting or owner or engine.preempted:
        appends = {}
        for slot in fill_slots(engine, queue, waiting, owner, rows_of, 0):
            cont = conts[owner[slot]]
            if cont:  # the slot waits on the prefix's last token: feed the continuation
                engine.slots.active[slot] = False
                appends[slot] = (list(cont), params.max_tokens)
            else:
                engine.slots.max_tokens[slot] = params.max_tokens
        engine.extend(appends)
        if not owner:
            raise RuntimeError("no request could be admitted; the page pool is too small")
        pending = len(queue) + sum(p.samples_left for p in waiting) + len(engine.preempted)
        exit_when = min(pending, refill_batch(engine)) if pending else None
        out = engine.generate(engine.config.decode_steps_per_call, exit_when_done=exit_when)
        drop_preempted(out, owner)  # they come back, their continuation fed, in other slots
        for slot, row in list(owner.items()):
            tokens[row].extend(out.tokens[slot, out.tokens[slot] >= 0].tolist())
            if out.finished[slot]:
                engine.free_resource(slot)
                del owner[slot]
    return tokens
