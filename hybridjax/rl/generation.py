"""The `gen` stage's work (rollout) and the actor weights it samples with.

`generate_batch` runs the paged engine on one batch of prompts (left-padded numpy arrays from
`hybridjax.data`) and returns an `RLBatch` placed in the training layout, plus the host-side
columns the reward function needs (data source, ground truth, extra info, repeated n times).
`Sampler` is the one place a step's batch is sampled, on the trainer's thread (sync) or on the
rollout thread (`trainer.rollout_mode` one_step_off / async); `RolloutWeights` re-lays the
actor's weights into the engine (the `reshard` stage, the hybrid engine).

Under `jax.distributed` each process generates only its share of the prompts
(`sharding.hosts`): `generate_batch` gathers the generated rows so every process holds the
whole batch's host columns (`HostColumns.mine` marks this process's rows, the ones it scores).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import needs_reward_baseline
from hybridjax.config.run import RunConfig
from hybridjax.models.config import to_dtype
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rl.multi_turn import MultiTurn
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.rollout.config import run_batch_seqs
from hybridjax.sharding import ACTOR_GENERATE_RULES, state_shardings
from hybridjax.sharding.hosts import allgather, local_mesh, to_local
from hybridjax.sharding.pools import sync_weights
from hybridjax.training.batch import RLBatch, make_batch
from hybridjax.training.build import Models


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
    return assemble_batch(prompts, out, sampling.n, sharding, multi_turn)


def assemble_batch(
    prompts: dict[str, Any],
    out: Any,
    n: int,
    sharding: NamedSharding,
    multi_turn: MultiTurn | None = None,
) -> tuple[RLBatch, HostColumns]:
    """The step's batch from `prompts` (B rows, as `generate_batch` takes them) and their
    B·n generated rows `out` (a `RolloutOutput`, or a multi-turn one with `multi_turn`),
    prompt-major; see `generate_batch` for what it returns and the host sync."""
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
    routed = None
    if out.routed_experts is not None:
        routed = routed_experts_array(out.routed_experts, prompt_mask, out.responses.shape[1])
    threshold = getattr(out, "rollout_logit_threshold", None)  # multi-turn: not recorded
    parts = allgather(
        (
            prompts["input_ids"],
            prompts["attention_mask"],
            out.rollout_log_probs,
            local,
            routed,
            threshold,
        )
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
    if routed is not None:
        batch = batch.replace(routed_experts=put(np.concatenate([p[4] for p in parts])))
    if threshold is not None:
        thresholds = np.concatenate([p[5] for p in parts])
        batch = batch.replace(rollout_logit_threshold=put(thresholds))
    return batch, host


def routed_experts_array(
    records: Sequence[np.ndarray], prompt_mask_BxP: np.ndarray, response_width: int
) -> np.ndarray:
    """The batch's `routed_experts` B×(P+R)×L×k int32 from the engine's per-row records
    (`RolloutOutput.routed_experts`: row i's fed tokens from its first prompt token, in
    order) for left-padded prompts (`prompt_mask_BxP`) and right-padded responses of width
    R: row i's record starts at its first prompt token, P − prompt_i. Positions no record
    covers (padding, the last sampled token) are -1, which the replay leaves to the router
    (`hybridjax.models.moe.MoEMLP`)."""
    b, p = prompt_mask_BxP.shape
    shape = next((r.shape[1:] for r in records if r.ndim == 3), (0, 0))
    out = np.full((b, p + response_width, *shape), -1, np.int32)
    for i, (record, length) in enumerate(zip(records, prompt_mask_BxP.sum(-1), strict=True)):
        start = p - int(length)
        out[i, start : start + len(record)] = record
    return out


def _concat(values: list) -> np.ndarray | list:
    if isinstance(values[0], np.ndarray):
        return np.concatenate(values)
    return [v for part in values for v in part]


def sampling_params(
    rollout: Any, seed: int, step: int, validate: bool = False, gen_batch: int = 0
) -> SamplingParams:
    """Sampling of step `step`'s generation batch `gen_batch` (several with dynamic sampling),
    or of validation, from `actor_rollout_ref.rollout` and `trainer.seed`: each with its own
    seed (salts 0, 2, 3, ... for generation batches, 1 for validation)."""
    salt = 1 if validate else gen_batch + (gen_batch > 0)
    return SamplingParams.from_config(rollout, validate=validate, seed=step_seed(seed, step, salt))


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Samples a step's batch: `rollout.n` responses per prompt (multi-turn trajectories with
    `multi_turn`), plus one greedy response per prompt when the estimator asks for a reward
    baseline (ReMax). The same code serves the sync `gen` stage and the rollout thread.

    Attributes:
      engine: the rollout engine (holds the weights it samples with).
      rollout: `actor_rollout_ref.rollout` (sampling keys).
      seed: `trainer.seed`.
      pad_token_id: fills responses past their end.
      sharding: the training mesh's batch axes (where the batch rows go).
      first_index: global index of this process's first prompt.
      multi_turn: tools for multi-turn rollouts, or None.
      baseline: also decode each prompt greedily.
    """

    engine: Engine
    rollout: Any
    seed: int
    pad_token_id: int
    sharding: NamedSharding
    first_index: int = 0
    multi_turn: MultiTurn | None = None
    baseline: bool = False

    def sample(self, prompts: dict[str, Any], step: int, gen_batch: int = 0):
        """(batch, host columns, (greedy batch, greedy host columns) or None) of `prompts`.
        Host sync: the whole rollout."""
        sampling = sampling_params(self.rollout, self.seed, step, gen_batch=gen_batch)
        run = lambda params: generate_batch(
            self.engine, prompts, params, self.pad_token_id, self.sharding, self.first_index,
            self.multi_turn,
        )  # fmt: skip
        batch, host = run(sampling)
        greedy = None
        if self.baseline:
            greedy = run(dataclasses.replace(sampling, n=1, temperature=0.0, top_k=-1, top_p=1.0))
        return batch, host, greedy


class RolloutWeights:
    """The actor's weights as the rollout samples with them: re-laid from the training layout
    into the rollout pool's generation layout and dtype, as this host's replica's arrays, then
    set in the engine, or with a rollout thread published to it as a policy version.

    Args:
      shardings: the generation layout of the actor's parameters.
      dtype: `rollout.dtype`.
      engine_mesh: this host's generation replica (`hosts.local_mesh`).
      co_located: the rollout shares the actor's devices; else each move is timed.
      forward: weights already in the generation layout and dtype are not copied: the engine
        reads the actor's own arrays (`reshard.update_weights`); only for synchronous rollouts,
        whose engine is done with them before the next update donates them.
    The trainer sets `engine` once the engine is built from the first `generation_params`,
    and `rollout_ahead` when a rollout thread samples.
    """

    def __init__(
        self, shardings: Any, dtype: Any, engine_mesh, co_located: bool, forward: bool = False
    ):
        self.shardings, self.dtype = shardings, dtype
        self.engine_mesh, self.co_located = engine_mesh, co_located
        self.forward = forward
        self.engine: Engine | None = None
        self.rollout_ahead = None
        self.sync_time = 0.0  # seconds of the last move between pools (split pools only)

    def generation_params(self, params: Any) -> tuple[Any, int]:
        """(`params` in the generation layout, as this host's replica's arrays, bytes moved).
        Split pools time the move as `sync_time` (`timing_s/update_weights`)."""
        start = time.perf_counter()
        out, nbytes = sync_weights(params, self.shardings, self.dtype, self.forward)
        if not self.co_located:
            jax.block_until_ready(out)
            self.sync_time = time.perf_counter() - start
        return to_local(out, self.engine_mesh), nbytes

    def update(self, params: Any, version: int) -> int:
        """Re-lays `params` (policy `version`) into the engine, or publishes them to the
        rollout thread; returns the bytes moved."""
        out, nbytes = self.generation_params(params)
        if self.rollout_ahead is None:
            self.engine.update_weights(out)
        else:
            self.rollout_ahead.publish(out, version)
        return nbytes


def build_rollout(
    cfg: ConfigDict, run: RunConfig, models: Models, tokenizer: Tokenizer, first_index: int
) -> tuple[RolloutWeights, Engine, Sampler, MultiTurn | None]:
    """The run's rollout: `RolloutWeights` (the actor's generation layout on the rollout pool),
    the paged `Engine` built on them (one generation replica per host: its host loop sees only
    local arrays), the `Sampler` of the step's batches (`first_index`: this process's first
    row of every batch) and the multi-turn tools (None without `rollout.multi_turn`)."""
    rollout, params = cfg.actor_rollout_ref.rollout, models.actor_state.params
    generate_mesh = run.meshes.generate
    shardings = state_shardings(params, generate_mesh, ACTOR_GENERATE_RULES)
    engine_mesh = local_mesh(generate_mesh)
    weights = RolloutWeights(
        shardings,
        to_dtype(rollout.dtype),
        engine_mesh,
        run.placement.co_located,
        forward=cfg.trainer.rollout_mode == "sync",  # no rollout thread reads them during updates
    )
    model = nnx.merge(models.actor_graphdef, weights.generation_params(params)[0])
    engine_config = RolloutConfig.from_config(rollout, run_batch_seqs(cfg))
    engine = Engine(model, engine_config, mesh=engine_mesh)
    weights.engine = engine
    multi_turn = MultiTurn.from_config(rollout.multi_turn, tokenizer)
    sampler = Sampler(
        engine,
        rollout,
        cfg.trainer.seed,
        tokenizer.pad_token_id,
        run.batch_sharding,
        first_index,
        multi_turn,
        needs_reward_baseline(cfg.algorithm.adv_estimator),
    )
    return weights, engine, sampler, multi_turn
