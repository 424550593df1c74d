"""The default RL step: a pipeline of named stages built from the config.

    gen → reward → old_log_prob → ref → values → adv → update_critic → update_actor → reshard

`default_pipeline(cfg)` reads as that line. Stages that a config does not need are left out
when the pipeline is built, never skipped inside the loop: `old_log_prob` unless the actor
update is on-policy (`build.recompute_old_log_prob`), `ref` without a KL term, `values` and
`update_critic` without a critic, `offload`/`onload` around `gen` with no offload key set,
`filter_groups` (DAPO's dynamic sampling) unless `algorithm.filter_groups.enable`. With an
estimator that asks for a reward baseline (ReMax) `gen` also decodes each prompt greedily and
`reward` scores it. Which algorithm runs is the registries' business.

Each device stage is a jitted function of `hybridjax.trainer.stages`, compiled once per process
and shared by every trainer (graph definitions and `StageConfig` static). `reward` starts
scoring and returns at once; the pipeline finishes it before `adv`, the first stage that reads
`token_level_scores`, so scoring overlaps the log-prob and value passes.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import ADV_ESTIMATORS, needs_reward_baseline
from hybridjax.metrics import compute_data_metrics
from hybridjax.sharding import load_to_device, offload_to_host
from hybridjax.sharding.pools import move_rows
from hybridjax.trainer import stages
from hybridjax.trainer.batch import RLBatch
from hybridjax.trainer.build import recompute_old_log_prob
from hybridjax.trainer.dynamic_sampling import FILTER_GROUPS
from hybridjax.trainer.generation import generate_batch
from hybridjax.trainer.multi_turn import multi_turn_metrics
from hybridjax.trainer.offload import any_offload, move_idle_states, offload_configs
from hybridjax.trainer.pipeline import (
    Deferred,
    Pipeline,
    PipelineError,
    Stage,
    StepContext,
    apply_entries,
    timed,
)

_old_log_prob = jax.jit(stages.compute_old_log_prob, static_argnums=(0, 3))
_ref_log_prob = jax.jit(stages.compute_ref_log_prob, static_argnums=(0, 3))
_values = jax.jit(stages.compute_values, static_argnums=(0, 3))
_advantage = jax.jit(stages.compute_advantage, static_argnums=2)
_update_actor = jax.jit(stages.update_actor, static_argnums=(0, 4), donate_argnums=1)
_update_critic = jax.jit(stages.update_critic, static_argnums=(0, 4), donate_argnums=1)
data_metrics = jax.jit(compute_data_metrics, static_argnums=1)

ROLLOUT = ("prompts", "responses", "response_mask", "attention_mask", "position_ids", "uid")
GENERATED = (*ROLLOUT, "rollout_log_probs")


def default_pipeline(cfg: ConfigDict) -> Pipeline:
    """The step for `cfg` (see the module docstring), before `trainer.stages` edits."""
    a, algo = cfg.actor_rollout_ref, cfg.algorithm
    offload = any_offload(offload_configs(cfg))
    baseline = needs_reward_baseline(algo.adv_estimator)
    critic = cfg.critic.enable
    return Pipeline([
        OFFLOAD if offload else None,
        GEN_WITH_BASELINE if baseline else GEN,
        ONLOAD if offload else None,
        REWARD_WITH_BASELINE if baseline else REWARD,
        FILTER_GROUPS if algo.filter_groups.enable else None,
        OLD_LOG_PROB if recompute_old_log_prob(cfg) else None,
        REF if a.actor.use_kl_loss or algo.use_kl_in_reward else None,
        VALUES if critic else None,
        ADV,
        UPDATE_CRITIC if critic else None,
        UPDATE_ACTOR,
        RESHARD,
    ])  # fmt: skip


def configured_pipeline(cfg: ConfigDict) -> Pipeline:
    """`default_pipeline(cfg)` with the `trainer.stages` entries applied, checked.

    Raises:
      PipelineError: a bad entry, or a stage reading a field no earlier stage writes.
    """
    return apply_entries(default_pipeline(cfg), cfg.trainer.stages)


def config_problems(cfg: ConfigDict) -> list[str]:
    """Problems of `trainer.stages` and `algorithm.filter_groups`, for the start-up check."""
    spec, problems = cfg.algorithm.filter_groups, []
    if spec.max_num_gen_batches < 0:
        problems.append(
            f"algorithm.filter_groups.max_num_gen_batches: must be >= 0 (0: no cap), got "
            f"{spec.max_num_gen_batches}"
        )
    if spec.enable and spec.metric == "seq_final_reward":
        problems.append(
            "algorithm.filter_groups.metric: 'seq_final_reward' (token_level_rewards) is made "
            "by the adv stage, after the filter; use 'seq_reward', 'score', 'acc' or a key of "
            "the reward function"
        )
    if spec.enable and not spec.metric:
        problems.append("algorithm.filter_groups.metric: empty")
    if spec.enable and cfg.trainer.log_train_generations:
        problems.append(
            "trainer.log_train_generations: not available with algorithm.filter_groups.enable "
            "(the trained rows come from several generation batches); set it to 0"
        )
    if cfg.algorithm.adv_estimator not in ADV_ESTIMATORS:  # reported with the registry names
        return problems
    try:
        configured_pipeline(cfg)
    except PipelineError as err:
        problems.append(str(err))
    return problems


# ------------------------------------------------------------------------- host stages


def _offload(batch, ctx: StepContext):
    ctx.models = move_idle_states(ctx.models, ctx.trainer.offload, offload_to_host)
    return batch


def _onload(batch, ctx: StepContext):
    ctx.models = move_idle_states(ctx.models, ctx.trainer.offload, load_to_device)
    return batch


def _gen(batch, ctx: StepContext, greedy: bool = False):
    """Samples `rollout.n` responses per prompt of `ctx.prompts` (and, with `greedy`, one greedy
    response per prompt into `ctx.greedy`); sets `ctx.host`. With `rollout.multi_turn` the
    responses are multi-turn trajectories with tools (adds the `multi_turn/*` metrics)."""
    t = ctx.trainer
    sampling = t.sampling(ctx.step, gen_batch=ctx.gen_batches)
    ctx.gen_batches += 1
    pad, first = t.tokenizer.pad_token_id, t.train_loader.rows.start or 0  # this process's
    generate = lambda params: generate_batch(
        t.engine, ctx.prompts, params, pad, t.batch_sharding, first, t.multi_turn
    )
    batch, ctx.host = generate(sampling)
    if t.multi_turn is not None:
        h = ctx.host
        ctx.metrics |= multi_turn_metrics(h.num_turns, h.tool_calls, h.tool_errors, h.row_mask)
    if greedy:
        ctx.greedy = generate(
            dataclasses.replace(sampling, n=1, temperature=0.0, top_k=-1, top_p=1.0)
        )
    return batch


def _reward(batch, ctx: StepContext, baseline: bool = False):
    """Starts scoring (rule functions in threads, the reward model queued on the device), or
    takes the scoring the rollout thread started as soon as it generated the batch
    (`ctx.scoring`); the finish fills `token_level_scores` (and `reward_baselines`: each
    prompt's greedy score)."""
    reward = ctx.trainer.reward
    if ctx.scoring is not None:
        pending, greedy = ctx.scoring
    else:
        pending = reward.submit(batch, ctx.host, ctx.step)
        greedy = reward.submit(*ctx.greedy, ctx.step) if baseline else None

    def finish(batch, ctx: StepContext):
        token_scores, ctx.reward = reward.collect(pending)
        metrics = dict(ctx.reward.metrics)
        moved = metrics.pop("perf/transfer_bytes", None)  # a reward model on its own pool
        ctx.metrics |= metrics
        if moved is not None:
            _count_transfer(ctx, moved)
        batch = batch.replace(token_level_scores=token_scores)
        if greedy is not None:
            n = ctx.stage_config.group_size
            batch = batch.replace(reward_baselines=reward.baselines(greedy, n))
        return batch

    return Deferred(finish)


def _reshard(batch, ctx: StepContext):
    """Re-lays the actor's weights out for generation (the hybrid engine)."""
    nbytes = ctx.trainer._update_weights()
    jax.block_until_ready(ctx.trainer.engine.state)
    ctx.metrics["perf/reshard_bytes"] = float(nbytes)
    return batch


# ------------------------------------------------------------------------- device stages


def _old_log_prob_stage(batch, ctx: StepContext):
    m = ctx.models
    batch, metrics = _old_log_prob(m.actor_graphdef, m.actor_state.params, batch, ctx.stage_config)
    ctx.metrics |= metrics
    return batch


def _to_pool(rows, sharding, ctx: StepContext):
    """`rows` moved into `sharding` (another pool's batch axes): device to device, timed as
    `timing_s/transfer` (within the stage's own time) and counted in `perf/transfer_bytes`.
    Host sync: waits for the copy, which the next pass needs anyway."""
    with timed(ctx.timing, "transfer"):
        moved, nbytes = move_rows(rows, sharding)
        jax.block_until_ready(moved)
    _count_transfer(ctx, nbytes)
    return moved


def _count_transfer(ctx: StepContext, nbytes: float) -> None:
    """Adds `nbytes` copied between pools to the step's `perf/transfer_bytes`."""
    ctx.metrics["perf/transfer_bytes"] = ctx.metrics.get("perf/transfer_bytes", 0.0) + nbytes


def _rows_for(role: str, batch, ctx: StepContext, *fields: str):
    """(the batch a `role` pass reads, its `StageConfig`): on the actor's pool `batch` itself;
    on the role's own pool a batch of the rollout fields and `fields`, moved there."""
    sharding = ctx.trainer.pool_batch_shardings.get(role)
    if sharding is None:
        return batch, ctx.stage_config
    rows = RLBatch(**{f: getattr(batch, f) for f in (*ROLLOUT, *fields)})
    return _to_pool(rows, sharding, ctx), ctx.trainer.stage_config_of(role)


def _back(role: str, batch, ctx: StepContext, **outputs):
    """`batch` with the per-token `outputs` of a `role` pass, moved back to the actor's pool
    when the role has its own."""
    if role in ctx.trainer.pool_batch_shardings:
        outputs = _to_pool(outputs, ctx.trainer.batch_sharding, ctx)
    return batch.replace(**outputs)


def _ref_stage(batch, ctx: StepContext):
    m = ctx.models  # the frozen copy, or with LoRA the actor with its adapters off
    rows, sc = _rows_for("ref", batch, ctx)
    out = _ref_log_prob(m.actor_graphdef, m.reference(), rows, sc)
    return _back("ref", batch, ctx, ref_log_prob=out.ref_log_prob)


def _values_stage(batch, ctx: StepContext):
    m = ctx.models
    rows, sc = _rows_for("critic", batch, ctx)
    out = _values(m.critic_graphdef, m.critic_state.params, rows, sc)
    return _back("critic", batch, ctx, values=out.values)


def _adv_stage(batch, ctx: StepContext):
    batch, ctx.trainer.kl_coef, metrics = _advantage(batch, ctx.trainer.kl_coef, ctx.stage_config)
    ctx.metrics |= metrics
    return batch


def _rng(ctx: StepContext) -> jax.Array:
    return jax.random.fold_in(jax.random.key(ctx.config.trainer.seed), ctx.step)


def _record_update(ctx: StepContext, metrics, nan_skipped) -> None:
    """Adds an update's metrics and its count of skipped non-finite optimizer steps."""
    ctx.metrics |= metrics
    ctx.metrics["nan_skipped"] = ctx.metrics.get("nan_skipped", 0) + nan_skipped


def _update_critic_stage(batch, ctx: StepContext):
    m = ctx.models
    rows, sc = _rows_for("critic", batch, ctx, "values", "returns")
    state, metrics, nan = _update_critic(m.critic_graphdef, m.critic_state, rows, _rng(ctx), sc)
    if "critic" in ctx.trainer.pool_batch_shardings:  # scalars, summed with the actor's
        replicated = NamedSharding(ctx.trainer.meshes.train, PartitionSpec())
        metrics, nan = jax.device_put((metrics, nan), replicated)
    ctx.models = dataclasses.replace(m, critic_state=state)
    _record_update(ctx, metrics, nan)
    return batch


def _update_actor_stage(batch, ctx: StepContext):
    """The actor update, from step `trainer.critic_warmup + 1` on (the critic warms up first)."""
    if ctx.step <= ctx.config.trainer.critic_warmup:
        return batch
    m = ctx.models
    state, metrics, nan = _update_actor(
        m.actor_graphdef, m.actor_state, batch, _rng(ctx), ctx.stage_config
    )
    ctx.models = dataclasses.replace(m, actor_state=state)
    _record_update(ctx, metrics, nan)
    return batch


OFFLOAD = Stage("offload", _offload)
GEN = Stage("gen", _gen, writes=GENERATED)
GEN_WITH_BASELINE = Stage("gen", lambda b, ctx: _gen(b, ctx, greedy=True), writes=GENERATED)
ONLOAD = Stage("onload", _onload)
REWARD = Stage("reward", _reward, reads=ROLLOUT, writes=("token_level_scores",))
REWARD_WITH_BASELINE = Stage(
    "reward",
    lambda b, ctx: _reward(b, ctx, baseline=True),
    reads=ROLLOUT,
    writes=("token_level_scores", "reward_baselines"),
)
OLD_LOG_PROB = Stage(
    "old_log_prob",
    _old_log_prob_stage,
    reads=ROLLOUT,
    writes=("old_log_probs", "rollout_is_weights", "response_mask"),
)
REF = Stage("ref", _ref_stage, reads=ROLLOUT, writes=("ref_log_prob",))
VALUES = Stage("values", _values_stage, reads=ROLLOUT, writes=("values",))
ADV = Stage(
    "adv",
    _adv_stage,
    reads=(*ROLLOUT, "token_level_scores"),
    writes=("token_level_rewards", "advantages", "returns"),
)
UPDATE_CRITIC = Stage("update_critic", _update_critic_stage, reads=("values", "returns"))
UPDATE_ACTOR = Stage("update_actor", _update_actor_stage, reads=(*ROLLOUT, "advantages"))
RESHARD = Stage("reshard", _reshard)
