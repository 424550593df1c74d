"""The host stages of the RL step (`hybridjax.rl.step.train_step` calls them): sampling
(`gen`), the engine's sleep, scoring (`start_reward`, `Scoring`), DAPO's filter, the
re-layout of the actor's weights for the engine (`reshard`), and the offloaded states'
placement before each stage (`place_offloaded`). Each is timed as `timing_s/<stage>` in the
step's `Record`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from hybridjax.rewards.manager import RewardResult
from hybridjax.rl import dynamic_sampling
from hybridjax.rl.async_rollout import staleness_metrics
from hybridjax.rl.generation import HostColumns
from hybridjax.rl.multi_turn import multi_turn_metrics
from hybridjax.rl.pipeline import MODEL_STATES, Record, StepContext, StepDeps, timed
from hybridjax.rl.reward import PendingScores
from hybridjax.sharding import OffloadConfig, load_to_device, offload_to_host
from hybridjax.training.batch import RLBatch
from hybridjax.training.build import Models
from hybridjax.training.offload import misplaced, move_states, offloaded_states
from hybridjax.training.residency import sleep_engine


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A generated batch and what comes with it.

    Attributes:
      prompts: the prompts it was sampled from (the loader's batch).
      batch: the `RLBatch` of `rollout.n` responses per prompt (the `GENERATED` fields).
      host: its per-row host columns.
      greedy: (batch, host) of one greedy response per prompt (ReMax's baseline), or None.
      scoring: (rows, greedy rows or None) of the scores the rollout thread started as soon as
        it generated the batch (None: `reward` starts them).
      policy_versions: per row, the policy version that generated it (rollout ahead only;
        with partial rollouts its oldest token's).
      token_versions: with partial rollouts, the version of each response token (B×R int64,
        -1 past the end).
    """

    prompts: dict[str, Any]
    batch: RLBatch
    host: HostColumns
    greedy: tuple[RLBatch, HostColumns] | None
    scoring: tuple[PendingScores, PendingScores | None] | None = None
    policy_versions: np.ndarray | None = None
    token_versions: np.ndarray | None = None


def place_offloaded(
    models: Models, uses: tuple[str, ...] | None, offload: Mapping[str, OffloadConfig], rec: Record
) -> Models:
    """`models` with the offloaded states a stage `uses` on the devices and the other offloaded
    ones in host memory (`offload.misplaced`); timed as `timing_s/offload` and
    `timing_s/onload`, their bytes (summed over devices) in `perf/offload_bytes` and
    `perf/onload_bytes`. Nothing for a stage that declares no uses (None), or with no offload
    key. Host sync: waits for the copies."""
    offloaded = offloaded_states(offload)
    if uses is None or not offloaded:
        return models
    away, back = misplaced(models, offloaded, uses)
    for names, move, name in ((away, offload_to_host, "offload"), (back, load_to_device, "onload")):
        if names:
            with timed(rec.timing, name):
                models, nbytes = move_states(models, names, move)
            rec.count(f"perf/{name}_bytes", float(nbytes))
    return models


def onload(models: Models, deps: StepDeps, rec: Record) -> Models:
    """Every offloaded state back on the devices (timed as `timing_s/onload`)."""
    models = place_offloaded(models, MODEL_STATES, deps.offload, rec)
    rec.timing.setdefault("onload", 0.0)
    return models


def gen(prompts: dict[str, Any] | None, deps: StepDeps, n: int, rec: Record, k: int = 0) -> Sampled:
    """Samples `rollout.n` responses per prompt of `prompts` (generation batch `k` of step `n`,
    each with its own seed; and, when the estimator asks for a baseline, one greedy response
    per prompt), or with a rollout thread takes the batch it sampled for this step (the
    stage's time is then the wait; the thread's generation time is `timing_s/rollout_gen`, the
    staleness `async/staleness_*`). With `rollout.multi_turn` the responses are multi-turn
    trajectories with tools (adds the `multi_turn/*` metrics). Timed as `timing_s/gen`."""
    with timed(rec.timing, "gen"):
        if deps.rollout_ahead is None:
            if prompts is None:
                raise ValueError("gen: no prompts, and no rollout thread to take a batch from")
            batch, host, greedy = deps.sampler.sample(prompts, n, k)
            sampled = Sampled(prompts, batch, host, greedy)
        else:
            rollout = deps.rollout_ahead.take(n, rec.timing)
            rec.timing["rollout_gen"] = rollout.timing["gen"]
            rec.timing["wait_update"] = rollout.timing["wait_update"]
            rec.metrics |= staleness_metrics(rollout.versions, n, rollout.token_versions)
            prompts, batch, host, greedy = rollout.output
            sampled = Sampled(
                prompts, batch, host, greedy, rollout.scoring, rollout.versions,
                rollout.token_versions,
            )  # fmt: skip
        if deps.multi_turn is not None:
            h = sampled.host
            rec.metrics |= multi_turn_metrics(h.num_turns, h.tool_calls, h.tool_errors, h.row_mask)
        return dataclasses.replace(sampled, batch=jax.block_until_ready(sampled.batch))


def sleep(models: Models, deps: StepDeps, rec: Record) -> None:
    """Releases the engine's KV pool (and its own weights) until the next rollout; timed as
    `timing_s/sleep`, the bytes in `perf/sleep_bytes`."""
    with timed(rec.timing, "sleep"):
        nbytes = sleep_engine(deps.weights.engine, models.actor_state.params)
        rec.metrics["perf/sleep_bytes"] = float(nbytes)


class Scoring:
    """The reward of a batch being scored (`start_reward`); `finish` collects it.

    Attributes:
      result: the rule reward's `RewardResult`, once finished (None before).
    """

    def __init__(
        self, deps: StepDeps, rec: Record, rows: PendingScores, greedy: PendingScores | None
    ):
        self.deps, self.rec, self.rows, self.greedy = deps, rec, rows, greedy
        self.result: RewardResult | None = None

    def finish(self, batch: RLBatch, ctx: StepContext) -> RLBatch:
        """`batch` with `token_level_scores` (and `reward_baselines`: each prompt's greedy
        score); the reward's metrics into the step's; `ctx.reward` set. Host sync: waits for
        the scores."""
        reward = self.deps.reward
        token_scores, self.result = reward.collect(self.rows)
        ctx.reward = self.result
        metrics = dict(self.result.metrics)
        moved = metrics.pop("perf/transfer_bytes", None)  # a reward model on its own pool
        self.rec.metrics |= metrics
        if moved is not None:
            self.rec.count("perf/transfer_bytes", moved)
        batch = batch.replace(token_level_scores=token_scores)
        if self.greedy is not None:
            n = self.deps.stage_cfg.group_size
            batch = batch.replace(reward_baselines=reward.baselines(self.greedy, n))
        return batch


def start_reward(batch: RLBatch, sampled: Sampled, deps: StepDeps, n: int, rec: Record) -> Scoring:
    """Starts scoring (rule functions in threads, the reward model queued on the device), or
    takes the scoring the rollout thread started as soon as it generated the batch
    (`sampled.scoring`); the greedy responses too when there are (ReMax's baseline). Timed as
    `timing_s/reward` (with the collection, `Scoring.finish`)."""
    with timed(rec.timing, "reward"):
        if sampled.scoring is not None:
            return Scoring(deps, rec, *sampled.scoring)
        rows = deps.reward.submit(batch, sampled.host, n)
        greedy = None if sampled.greedy is None else deps.reward.submit(*sampled.greedy, n)
        return Scoring(deps, rec, rows, greedy)


def filter_groups(
    batch: RLBatch,
    host: HostColumns,
    reward: RewardResult | None,
    deps: StepDeps,
    rec: Record,
    resample: Callable[[int], tuple[RLBatch, HostColumns, RewardResult | None]],
) -> tuple[RLBatch, HostColumns]:
    """DAPO's dynamic sampling (`hybridjax.rl.dynamic_sampling.filter_groups`) with this run's
    keys and batch sharding; timed as `timing_s/filter_groups` (the extra batches included)."""
    cfg = deps.config
    with timed(rec.timing, "filter_groups"):
        batch, host, metrics = dynamic_sampling.filter_groups(
            batch, host, reward, cfg.algorithm.filter_groups, cfg.data.train_batch_size,
            deps.run.batch_sharding, resample,
        )  # fmt: skip
        rec.metrics |= metrics
        return jax.block_until_ready(batch), host


def reshard(models: Models, deps: StepDeps, n: int, rec: Record) -> None:
    """Re-lays the actor's weights out for generation (the hybrid engine), as policy version
    `n`; timed as `timing_s/reshard`, its bytes in `perf/reshard_bytes`."""
    with timed(rec.timing, "reshard"):
        if (engine := deps.weights.engine) is None:
            raise ValueError("reshard: the rollout weights have no engine to set")
        nbytes = deps.weights.update(models.actor_state.params, n)
        jax.block_until_ready(engine.state)
        rec.metrics["perf/reshard_bytes"] = float(nbytes)
