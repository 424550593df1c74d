"""The `gen` stage (rollout) and the `reward` stage's host side, at the edge of the device step.

`generate_batch` runs the paged engine on one batch of prompts (left-padded numpy arrays from
`hybridjax.data`) and returns an `RLBatch` placed in the training layout, plus the host-side
columns the reward function needs (data source, ground truth, extra info, repeated n times).
`submit_rewards` decodes the responses and starts scoring them in the reward manager's thread
pool; the trainer collects the future after the device stages that do not need scores.

Under `jax.distributed` each process generates and scores only its share of the prompts
(`sharding.hosts`): `generate_batch` gathers the generated rows so every process holds the
whole batch's host columns, `submit_rewards` scores only this process's rows and
`collect_rewards` gathers the results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards import RewardManager, RewardResult, concat_results, decode_responses
from hybridjax.rollout import Engine, SamplingParams, generate
from hybridjax.sharding.hosts import allgather
from hybridjax.trainer.batch import RLBatch, make_batch
from hybridjax.trainer.multi_turn import MultiTurn


@dataclasses.dataclass(frozen=True)
class HostColumns:
    """Per-response host values (B·n rows): what the reward function reads, and the lengths."""

    data_source: list[str]
    ground_truth: list[Any]
    extra_info: list[Any]
    row_mask: np.ndarray  # bool (B·n,): False on rows that only pad a short validation batch
    prompt_lengths: np.ndarray  # int (B·n,)
    response_lengths: np.ndarray  # int (B·n,): up to the last model token
    responses: np.ndarray  # (B·n)×R int32, for decoding
    response_mask: np.ndarray  # (B·n)×R: model tokens
    # Multi-turn rollouts (None: single-turn values, filled in by __post_init__):
    valid_mask: np.ndarray | None = None  # (B·n)×R: every response token (tool ones included)
    num_turns: np.ndarray | None = None  # int (B·n,): assistant turns
    tool_calls: np.ndarray | None = None  # int (B·n,)
    tool_errors: np.ndarray | None = None  # int (B·n,)
    mine: slice = dataclasses.field(
        default_factory=lambda: slice(None)
    )  # rows this process scores (its share of the prompts)

    def __post_init__(self):
        rows = len(self.row_mask)
        defaults = dict(
            valid_mask=self.response_mask,
            num_turns=np.ones(rows, np.int32),
            tool_calls=np.zeros(rows, np.int32),
            tool_errors=np.zeros(rows, np.int32),
        )
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def share(self) -> HostColumns:
        """The columns of the rows this process scores."""
        rows = self.mine
        return HostColumns(
            *(getattr(self, f.name)[rows] for f in dataclasses.fields(self) if f.name != "mine")
        )


def put_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds whole, placed as `sharding` (each process
    transfers only its own shards, so this also works when the mesh spans several hosts)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A sampling seed per (run seed, step): every step samples fresh, a resumed step the same."""
    return int(np.random.SeedSequence([seed, step, salt]).generate_state(1)[0] & 0x7FFFFFFF)


def generate_batch(
    engine: Engine,
    prompts: dict[str, Any],
    sampling: SamplingParams,
    pad_token_id: int,
    sharding: NamedSharding,
    first_index: int = 0,
    multi_turn: MultiTurn | None = None,
) -> tuple[RLBatch, HostColumns]:
    """Samples `sampling.n` responses per prompt and assembles the step's batch.

    Args:
      engine: an idle rollout engine holding the current actor weights.
      prompts: a batch from `hybridjax.data` (`input_ids`, `attention_mask` B×P left padded,
        `data_source`, `ground_truth`, `extra_info`, `row_mask`).
      sampling: sampling parameters (n, temperature, ..., seed).
      pad_token_id: fills responses past their end.
      sharding: where the batch rows go (the training mesh's batch axes).
      first_index: the global index of the first prompt (this process's share starts there).
      multi_turn: tools for multi-turn rollouts (None: single-turn); tool tokens are attended
        to but masked out of `response_mask`, and `extra_info` gains the trajectory.
    Returns:
      (RLBatch with `rollout_log_probs` and `uid` = the prompt's index in the whole batch,
      HostColumns), rows ordered prompt-major (n contiguous); both hold every process's rows,
      `HostColumns.mine` marks this process's.
    Host sync: the whole rollout (the engine returns numpy arrays), and a gather across
    processes under `jax.distributed`.
    """
    run = generate if multi_turn is None else multi_turn.generate
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    out = run(engine, ids, sampling, mask, pad_token_id, first_index=first_index)
    n = sampling.n
    repeat = lambda values: [v for v in values for _ in range(n)]
    prompt_mask = np.repeat(prompts["attention_mask"], n, axis=0)
    extra_info = repeat(prompts["extra_info"])
    valid = turns = calls = errors = None  # single-turn values (`HostColumns`)
    if multi_turn is not None:
        extra_info = multi_turn.extra_info(out, extra_info)
        lengths = np.array([sum(len(t) for _, t in row) for row in out.turns])
        valid = (np.arange(out.responses.shape[1]) < lengths[:, None]).astype(np.int32)
        turns, calls, errors = out.num_turns, out.tool_calls, out.tool_errors
    model = out.response_mask.astype(bool)
    last_model_token = np.where(model.any(-1), model.shape[1] - np.argmax(model[:, ::-1], -1), 0)
    local = HostColumns(
        data_source=repeat(prompts["data_source"]),
        ground_truth=repeat(prompts["ground_truth"]),
        extra_info=extra_info,
        row_mask=np.repeat(np.asarray(prompts["row_mask"], bool), n),
        prompt_lengths=prompt_mask.sum(-1),
        response_lengths=last_model_token,
        responses=out.responses,
        response_mask=out.response_mask,
        valid_mask=valid,
        num_turns=turns,
        tool_calls=calls,
        tool_errors=errors,
    )
    parts = allgather(
        (prompts["input_ids"], prompts["attention_mask"], out.rollout_log_probs, local)
    )
    host = HostColumns(
        *(_concat([getattr(p[3], f.name) for p in parts]) for f in dataclasses.fields(local)[:-1])
    )
    start = sum(len(p[3].row_mask) for p in parts[: jax.process_index()])
    host = dataclasses.replace(host, mine=slice(start, start + len(local.row_mask)))
    put = lambda x: put_global(np.asarray(x), sharding)
    prompt_ids = np.concatenate([p[0] for p in parts])
    batch = make_batch(
        put(np.repeat(prompt_ids, n, axis=0)),
        put(np.repeat(np.concatenate([p[1] for p in parts]), n, axis=0)),
        put(host.responses),
        put(host.response_mask.astype(np.float32)),
        put(np.concatenate([p[2] for p in parts])),
        put(np.repeat(np.arange(len(prompt_ids), dtype=np.int32), n)),
        put(host.valid_mask.astype(np.float32)),
    )
    return batch, host


def _concat(values: list) -> np.ndarray | list:
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    return [v for part in values for v in part]


def submit_rewards(
    manager: RewardManager, tokenizer: Tokenizer, host: HostColumns
) -> concurrent.futures.Future[RewardResult]:
    """Decodes this process's responses and starts scoring them (returns at once)."""
    host = host.share()
    texts = decode_responses(tokenizer, host.responses, host.valid_mask)
    return manager.submit(
        texts,
        host.data_source,
        host.ground_truth,
        host.extra_info,
        host.response_lengths,
        host.responses.shape[1],
    )


def collect_rewards(pending: concurrent.futures.Future[RewardResult]) -> RewardResult:
    """Waits for this process's scores and gathers every process's, in row order."""
    return concat_results(allgather(pending.result()))
