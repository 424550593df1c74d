"""The device side of one RL step, as two straight lines of timed stages over the run's models.

    prepare: reward (submitted) → old_log_prob → ref → values → reward (collected) → adv
    update:  update_critic → update_actor

`old_log_prob` runs only when `StageConfig.recompute_old_log_prob` (the update is not exactly
on-policy, or the config forces it); otherwise `update_actor` takes π_old from its own forward
pass and no `timing_s/old_log_prob` is reported.

Each stage is a jitted function of `hybridjax.trainer.stages`, compiled once per process and
shared by every trainer (graph definitions and `StageConfig` static). Each ends with a device
sync so `timing_s/<stage>` is the stage's own time. Which stages run follows from the models
present (a reference copy, a critic) and the batch (greedy baselines); which algorithm runs is
the registries' business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from hybridjax.metrics import compute_data_metrics
from hybridjax.rewards import RewardResult
from hybridjax.trainer import stages
from hybridjax.trainer.batch import RLBatch
from hybridjax.trainer.build import Models
from hybridjax.trainer.generation import HostColumns
from hybridjax.trainer.reward import RewardStage
from hybridjax.trainer.stages import StageConfig

_old_log_prob = jax.jit(stages.compute_old_log_prob, static_argnums=(0, 3))
_ref_log_prob = jax.jit(stages.compute_ref_log_prob, static_argnums=(0, 3))
_values = jax.jit(stages.compute_values, static_argnums=(0, 3))
_advantage = jax.jit(stages.compute_advantage, static_argnums=2)
_update_actor = jax.jit(stages.update_actor, static_argnums=(0, 4), donate_argnums=1)
_update_critic = jax.jit(stages.update_critic, static_argnums=(0, 4), donate_argnums=1)
data_metrics = jax.jit(compute_data_metrics, static_argnums=1)
log = logging.getLogger(__name__)


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str):
    """Adds the wall time of the block to `timing[name]` (seconds). The block is a named range
    in JAX profiler traces, and its start and end (`time.time()`) are logged at DEBUG level
    on this module's logger (`stage <name> <start> <end>`; the benchmarks' per-step log)."""
    start, wall = time.perf_counter(), time.time()
    with jax.profiler.TraceAnnotation(name):
        yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start
    log.debug("stage %s %.6f %.6f", name, wall, time.time())


def prepare(
    models: Models,
    batch: RLBatch,
    host: HostColumns,
    greedy: tuple[RLBatch, HostColumns] | None,
    reward: RewardStage,
    kl_coef: jax.Array,
    cfg: StageConfig,
    timing: dict[str, float],
) -> tuple[RLBatch, jax.Array, dict[str, jax.Array], RewardResult]:
    """Stages `reward`, `old_log_prob` (when `cfg.recompute_old_log_prob`), `ref`, `values`,
    `adv` on a generated batch. Scoring (rule functions in threads, the reward model queued)
    overlaps the log-prob and value passes; `greedy` (one greedy response per prompt) is
    scored into `reward_baselines`.

    Returns (batch with advantages, next KL coefficient, device metrics, the rule's result).
    """
    device = {}
    with timed(timing, "reward"):
        scores = reward.submit(batch, host)
        greedy_scores = reward.submit(*greedy) if greedy else None
    if cfg.recompute_old_log_prob:
        with timed(timing, "old_log_prob"):
            batch, m = _old_log_prob(models.actor_graphdef, models.actor_state.params, batch, cfg)
            device |= jax.block_until_ready(m)
    if (ref_params := models.reference()) is not None:
        with timed(timing, "ref"):
            batch = _ref_log_prob(models.actor_graphdef, ref_params, batch, cfg)
            jax.block_until_ready(batch.ref_log_prob)
    if models.critic_state is not None:
        with timed(timing, "values"):
            batch = _values(models.critic_graphdef, models.critic_state.params, batch, cfg)
            jax.block_until_ready(batch.values)
    with timed(timing, "reward"):
        token_scores, result = reward.collect(scores)
        batch = batch.replace(token_level_scores=token_scores)
        if greedy_scores is not None:
            baselines = reward.baselines(greedy_scores, cfg.group_size)
            batch = batch.replace(reward_baselines=baselines)
    with timed(timing, "adv"):
        batch, kl_coef, m = _advantage(batch, kl_coef, cfg)
        device |= jax.block_until_ready(m)
    return batch, kl_coef, device, result


def update(
    models: Models,
    batch: RLBatch,
    rng: jax.Array,
    cfg: StageConfig,
    update_actor: bool,
    timing: dict[str, float],
) -> tuple[Models, dict[str, jax.Array]]:
    """Stages `update_critic` (with a critic) and `update_actor` (when `update_actor`, i.e.
    after `trainer.critic_warmup` steps). The old states are donated.

    Returns (models with the new states, device metrics plus `nan_skipped`, the number of
    optimizer steps skipped for non-finite loss or gradients).
    """
    device, nan_skipped = {}, jnp.zeros((), jnp.int32)
    if models.critic_state is not None:
        with timed(timing, "update_critic"):
            state, m, nan = _update_critic(
                models.critic_graphdef, models.critic_state, batch, rng, cfg
            )
            models = dataclasses.replace(models, critic_state=state)
            device |= jax.block_until_ready(m)
            nan_skipped += nan
    if update_actor:
        with timed(timing, "update_actor"):
            state, m, nan = _update_actor(
                models.actor_graphdef, models.actor_state, batch, rng, cfg
            )
            models = dataclasses.replace(models, actor_state=state)
            device |= jax.block_until_ready(m)
            nan_skipped += nan
    return models, device | {"nan_skipped": nan_skipped}
