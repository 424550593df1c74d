"""Multi-turn rollouts with tools: `generate_multi_turn(engine, prompts, params, handler, ...)`.

Each sample is a trajectory of token ids (token in, token out: nothing is re-tokenized):

    prompt | assistant turn 1 | tool response 1 | assistant turn 2 | ... | last assistant turn

An assistant turn ends on a stop token (EOS). `handler.parse` reads the turn's tool calls; if
there are any (and `max_assistant_turns` is not reached) the slot pauses, holding its pages,
while `handler.execute` runs the calls on a host thread, and the other slots keep decoding.
When the results are in, `handler.render` gives the tool response's token ids (rendered once,
with the chat template's tool role), which are appended to the trajectory: `Engine.extend`
computes only them on top of the cached keys/values of the earlier turns, and decoding goes on.
`max_tokens` bounds the whole response (model and tool tokens); a tool response that does not
fit is cut and ends the trajectory ("length").

`response_mask` is 1 on model tokens and 0 on tool tokens; `rollout_log_probs` are those of
model tokens (0 on tool tokens), equal to the trainer's forward over the whole trajectory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hybridjax.rollout.batching import (
    RolloutOutput,
    drop_preempted,
    fill_slots,
    make_requests,
    pad_rows,
    refill_batch,
)
from hybridjax.rollout.config import SamplingParams
from hybridjax.rollout.engine import Engine
from hybridjax.rollout.pages import Prefix


class TurnHandler(Protocol):
    """What the loop needs from the tools side (`hybridjax.tools.chat.ChatTools` for chats)."""

    def parse(self, turn_ids: list[int]) -> list[Any]:
        """The calls in one assistant turn (token ids), [] when it calls nothing."""

    def execute(self, calls: list[Any]) -> list[Any]:
        """Runs the calls (on a worker thread); one result per call, never raises."""

    def render(self, calls: list[Any], results: list[Any]) -> list[int]:
        """The token ids of the tool response message(s) that follow the assistant turn."""

    def is_error(self, result: Any) -> bool:
        """Whether a call failed (counted in `tool_errors`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiTurnOutput(RolloutOutput):
    """`RolloutOutput` of multi-turn rollouts (response_mask 0 on tool tokens) plus, per row:

    num_turns: int32 assistant turns; tool_calls / tool_errors: int32 calls made / failed;
    turns: the trajectory as ("assistant" | "tool", token ids) segments in order;
    calls: per row, (call, result) pairs in order.
    """

    num_turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    turns: tuple = ()
    calls: tuple = ()


@dataclasses.dataclass
class _Trajectory:
    limit: int  # max_tokens of its request: model and tool tokens
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    turn_start: int = 0
    turns: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    calls: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    errors: int = 0
    reason: str = "length"
    routing: Any = None  # with routing replay: `Engine.routing_of` its slot, when it finished

    def add(self, tokens, mask_value: int, log_probs=None) -> None:
        self.tokens += list(tokens)
        self.mask += [mask_value] * len(tokens)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(tokens)


def generate_multi_turn(
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    sampling_params: SamplingParams | Sequence[SamplingParams],
    handler: TurnHandler,
    max_assistant_turns: int,
    max_parallel_calls: int = 1,
    attention_mask: np.ndarray | None = None,
    pad_token_id: int = 0,
    first_index: int = 0,
    tool_threads: int = 8,
) -> MultiTurnOutput:
    """Samples `n` multi-turn trajectories per prompt with continuous batching across turns.

    Args:
      engine, prompt_ids, sampling_params, attention_mask, pad_token_id, first_index: as
        `hybridjax.rollout.generate`; `max_tokens` bounds the whole response, tool tokens included.
      handler: parses calls, executes them, renders their responses (`TurnHandler`).
      max_assistant_turns: assistant turns per trajectory (verl's
        `multi_turn.max_assistant_turns`); the last one's calls are not executed.
      max_parallel_calls: calls of one turn executed; later ones are dropped (verl's key).
      tool_threads: trajectories whose calls run at once.
    Returns: `MultiTurnOutput`, rows prompt-major (n contiguous).
    Raises: as `generate`; ValueError if max_assistant_turns < 1.
    """
    if max_assistant_turns < 1:
        raise ValueError(f"max_assistant_turns must be >= 1, got {max_assistant_turns}")
    requests = make_requests(engine, prompt_ids, sampling_params, attention_mask, first_index)
    first_row = np.cumsum([0] + [r.params.n for r in requests])
    width = max((r.params.max_tokens for r in requests), default=1)
    rows = [_Trajectory(r.params.max_tokens) for r in requests for _ in range(r.params.n)]
    queue = collections.deque(requests)
    waiting: collections.deque[Prefix] = collections.deque()
    owner: dict[int, int] = {}  # slot -> output row (decoding or waiting for its tools)
    running: dict[int, concurrent.futures.Future] = {}  # slot -> its tools' results
    steps = engine.config.decode_steps_per_call

    def finish(slot: int, reason: str) -> None:
        traj = rows[owner.pop(slot)]
        traj.reason = reason
        if engine.record_routing:
            traj.routing = engine.routing_of(slot)
        engine.free_resource(slot)

    with concurrent.futures.ThreadPoolExecutor(tool_threads, "tools") as pool:
        while queue or waiting or owner or engine.preempted:
            fill_slots(engine, queue, waiting, owner, first_row, first_index)
            if not owner and not any(p.to_prefill for p in waiting):
                raise RuntimeError("no request could be admitted; the page pool is too small")
            appends = {}
            for slot in [s for s, f in running.items() if f.done()]:
                calls, results = running.pop(slot).result()
                traj = rows[owner[slot]]
                traj.calls += list(zip(calls, results, strict=True))
                traj.errors += sum(map(handler.is_error, results))
                ids = handler.render(calls, results)
                room = traj.limit - len(traj.tokens)
                traj.add(ids[:room], 0)
                traj.turns.append(("tool", ids[:room]))
                if len(ids) >= room:  # no room left for the model: the trajectory ends
                    finish(slot, "length")
                else:
                    traj.turn_start = len(traj.tokens)
                    appends[slot] = (ids, room - len(ids))
            engine.extend(appends)
            if not engine.num_active:
                if running:
                    concurrent.futures.wait(running.values(), return_when="FIRST_COMPLETED")
                continue
            out = engine.generate(steps, exit_when_done=refill_batch(engine))
            drop_preempted(out, owner)
            for slot, row in list(owner.items()):
                valid = out.tokens[slot] >= 0
                traj = rows[row]
                traj.add(out.tokens[slot, valid].tolist(), 1, out.log_probs[slot, valid].tolist())
                if not out.finished[slot]:
                    continue
                turn = traj.tokens[traj.turn_start :]
                traj.turns.append(("assistant", turn))
                calls = []
                assistant_turns = (len(traj.turns) + 1) // 2  # turns alternate, assistant first
                if out.stopped[slot] and assistant_turns < max_assistant_turns:
                    calls = handler.parse(turn)[:max_parallel_calls]
                if not calls or len(traj.tokens) >= traj.limit:
                    finish(slot, "stop" if out.stopped[slot] else "length")
                    continue
                running[slot] = pool.submit(lambda c: (c, handler.execute(c)), calls)

    count = lambda f: np.array([f(t) for t in rows], np.int32)
    return MultiTurnOutput(
        *pad_rows(
            [t.tokens for t in rows],
            [t.mask for t in rows],
            [t.log_probs for t in rows],
            width,
            pad_token_id,
        ),
        finish_reason=tuple(t.reason for t in rows),
        routed_experts=tuple(t.routing for t in rows) if engine.record_routing else None,
        num_turns=count(lambda t: sum(kind == "assistant" for kind, _ in t.turns)),
        tool_calls=count(lambda t: len(t.calls)),
        tool_errors=count(lambda t: t.errors),
        turns=tuple(tuple(t.turns) for t in rows),
        calls=tuple(tuple(t.calls) for t in rows),
    )
