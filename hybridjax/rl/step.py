"""One RL step, `train_step(state, prompts, deps) -> (state, metrics)`, stage after stage:

    gen → reward → old_log_prob → ref → teacher → values → adv → update_critic → update_actor
        → reshard

`train_step` reads as that line; each stage is a function below, in the same order, that takes
the batch and the step's `StepContext` (its typed, read-only `StepDeps` and the models and KL
coefficient it may replace) and returns the batch. The stages a run has are its pipeline
(`default_pipeline(cfg)` plus the `trainer.stages` edits, or one given from Python):
`train_step` runs the pipeline's stages at its named points, so a user stage placed after
`reward` runs right after it, and a replaced stage runs in place of the default. Stages that
a config does not need are left out when the pipeline is built (their point runs nothing):
`old_log_prob` unless the actor update is off-policy (`build.recompute_old_log_prob`), `ref`
without a KL term, `teacher` without on-policy distillation (`actor_rollout_ref.distillation`),
`values` and `update_critic` without a critic, `onload` (the last stage) with no offload
key set, `filter_groups` (DAPO's dynamic sampling) unless
`algorithm.filter_groups.enable`, `sleep` (the engine's KV pool and own weights released
after the rollout, `hybridjax.training.residency`) unless `rollout.free_cache_engine`. With an
estimator that asks for a reward baseline (ReMax) `gen` also decodes each prompt greedily and
`reward` scores it. Which algorithm runs is the
registries' business.

Each device stage calls a jitted pass of `hybridjax.training.passes`, compiled once per process
and shared by every trainer (graph definitions and `StageConfig` static). `reward` starts
scoring and returns at once; the pipeline finishes it before `adv`, the first stage that reads
`token_level_scores`, so scoring overlaps the log-prob and value passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import ADV_ESTIMATORS, needs_reward_baseline
from hybridjax.config.run import RunConfig
from hybridjax.metrics import compute_data_metrics, compute_perf_metrics
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rl.async_rollout import RolloutAhead, staleness_metrics
from hybridjax.rl.dynamic_sampling import FILTER_GROUPS
from hybridjax.rl.evaluation import generation_samples
from hybridjax.rl.generation import RolloutWeights, Sampler
from hybridjax.rl.multi_turn import MultiTurn, multi_turn_metrics
from hybridjax.rl.pipeline import (
    MODEL_STATES,
    Deferred,
    Pipeline,
    PipelineError,
    Runner,
    Stage,
    StepContext,
    apply_entries,
    timed,
)
from hybridjax.rl.reward import RewardStage
from hybridjax.sharding import OffloadConfig, load_to_device, offload_to_host
from hybridjax.sharding.layout import jit_keeping_state
from hybridjax.sharding.mesh import pass_mesh
from hybridjax.sharding.pools import move_rows
from hybridjax.sharding.roles import Roles
from hybridjax.training import passes
from hybridjax.training.batch import RLBatch
from hybridjax.training.build import Models, recompute_old_log_prob
from hybridjax.training.offload import (
    any_offload,
    misplaced,
    move_states,
    offload_configs,
    offloaded_states,
)
from hybridjax.training.passes import StageConfig
from hybridjax.training.residency import free_cache_engine, sleep_engine

_old_log_prob = jax.jit(passes.compute_old_log_prob, static_argnums=(0, 3))
_ref_log_prob = jax.jit(passes.compute_ref_log_prob, static_argnums=(0, 3))
_teacher_log_prob = jax.jit(passes.compute_teacher_log_prob, static_argnums=(0, 3))
_values = jax.jit(passes.compute_values, static_argnums=(0, 3))
_advantage = jax.jit(passes.compute_advantage, static_argnums=2)
# the updates donate their state and return it in its input's layout (`sharding.layout`)
_update_actor = jit_keeping_state(passes.update_actor, static_argnums=(0, 4), state_argnum=1)
_update_critic = jit_keeping_state(passes.update_critic, static_argnums=(0, 4), state_argnum=1)
data_metrics = jax.jit(compute_data_metrics, static_argnums=1)

ROLLOUT = ("prompts", "responses", "response_mask", "attention_mask", "position_ids", "uid")
GENERATED = (*ROLLOUT, "rollout_log_probs", "rollout_logit_threshold", "routed_experts")


def default_pipeline(cfg: ConfigDict) -> Pipeline:
    """The step for `cfg` (see the module docstring), before `trainer.stages` edits."""
    algo, roles = cfg.algorithm, Roles.from_config(cfg)
    offload = any_offload(offload_configs(cfg))
    baseline = needs_reward_baseline(algo.adv_estimator)
    critic, sleep = roles.critic, free_cache_engine(cfg)
    return Pipeline([
        GEN,
        SLEEP if sleep and not algo.filter_groups.enable else None,
        REWARD_WITH_BASELINE if baseline else REWARD,
        FILTER_GROUPS if algo.filter_groups.enable else None,
        SLEEP if sleep and algo.filter_groups.enable else None,  # it generates more batches
        OLD_LOG_PROB if recompute_old_log_prob(cfg) else None,
        REF if roles.reference else None,
        TEACHER if roles.teacher else None,
        VALUES if critic else None,
        ADV,
        UPDATE_CRITIC if critic else None,
        UPDATE_ACTOR,
        RESHARD,
        ONLOAD if offload else None,
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


@dataclasses.dataclass(frozen=True)
class StepDeps:
    """What a step reads and never changes, built once by the trainer.

    Attributes:
      run: the resolved run config (`hybridjax.config.run.RunConfig`: the ConfigDict, roles,
        shardings, the `StageConfig` of each pool).
      pipeline: the stages this run's step has (see the module docstring).
      sampler: samples the step's batch (the sync `gen`).
      rollout_ahead: the rollout thread (`trainer.rollout_mode` one_step_off / async) that
        `gen` takes the batch from; None: `gen` samples with `sampler`.
      weights: re-lays the actor's weights into the engine (`reshard`).
      reward: scores responses (`reward`).
      tokenizer: the actor's tokenizer.
      train_loader: the prompt loader (DAPO's dynamic sampling draws more batches).
      replicated: a replicated sharding on the actor's training mesh (scalar metrics).
      multi_turn: tools of multi-turn rollouts, or None.
      offload: `fsdp_config.*_offload` per role (`place_offloaded` before each stage).
      n_devices, peak_flops: what `perf/*` metrics are computed from, with the actor's shape.
    """

    run: RunConfig
    pipeline: Pipeline
    sampler: Sampler
    rollout_ahead: RolloutAhead | None
    weights: RolloutWeights
    reward: RewardStage
    tokenizer: Tokenizer
    train_loader: Any
    replicated: NamedSharding
    multi_turn: MultiTurn | None
    offload: Mapping[str, OffloadConfig]
    n_devices: int
    peak_flops: float

    @property
    def config(self) -> ConfigDict:
        """The run's ConfigDict (user stages read their keys here)."""
        return self.run.cfg

    @property
    def stage_cfg(self) -> StageConfig:
        """The `StageConfig` of the passes on the actor's pool."""
        return self.run.stage_cfg


@dataclasses.dataclass(frozen=True)
class StepState:
    """What a step changes: the models (weights and optimizer states) and the adaptive KL
    coefficient (a float32 scalar on the devices)."""

    models: Models
    kl_coef: jax.Array


def train_step(
    state: StepState, prompts: dict[str, Any] | None, deps: StepDeps, n: int
) -> tuple[StepState, dict[str, Any], StepContext]:
    """RL step `n` on `prompts` (None: `gen` takes the batch the rollout thread sampled).

    Returns:
      (the new state, the step's metrics as host floats (timers `timing_s/<stage>`, `perf/*`,
      the stages' metrics, `nan_skipped`: skipped non-finite optimizer steps), the step's
      context (host columns, prompts, reward result)).
    Host sync: each stage waits for its device work; metrics are pulled once at the end.
    """
    ctx = StepContext(n, deps, state.models, state.kl_coef, prompts)
    # each line: the user's stages before it, then the stage; before each, the offloaded model
    # states it uses go to the devices and the others to host memory (`place_offloaded`)
    at = Runner(deps.pipeline, ctx, place_offloaded)
    with timed(ctx.timing, "step"):
        batch = at(GEN, None)  # rollout.n responses per prompt (+ greedy ones for ReMax)
        batch = at(SLEEP, batch)  # KV pool freed until the next gen (DAPO: after its filter)
        batch = at(REWARD, batch)  # starts scoring; finished before the first reader (adv)
        batch = at(FILTER_GROUPS, batch)  # DAPO: generate again until groups vary
        batch = at(OLD_LOG_PROB, batch)  # π_old (off-policy updates only)
        batch = at(REF, batch)  # π_ref (a KL term)
        batch = at(TEACHER, batch)  # π_teacher (on-policy distillation)
        batch = at(VALUES, batch)  # V(s) (a critic)
        batch = at(ADV, batch)  # token rewards (KL penalty), advantages, returns
        batch = at(UPDATE_CRITIC, batch)
        batch = at(UPDATE_ACTOR, batch)
        batch = at(RESHARD, batch)  # the new actor weights into the rollout engine
        batch = at(ONLOAD, batch)  # offloaded states back on the devices between steps
        batch = at.finish(batch)  # the user's stages after the last point
        ctx.metrics |= data_metrics(batch, deps.run.roles.critic)
        metrics = {k: float(v) for k, v in jax.device_get(ctx.metrics).items()}  # host sync
    return StepState(ctx.models, ctx.kl_coef), metrics | _step_metrics(ctx), ctx


def _step_metrics(ctx: StepContext) -> dict[str, Any]:
    """The timers, `perf/*` and `train/generations` of a finished step."""
    d, host = ctx.deps, ctx.host
    metrics = {f"timing_s/{k}": v for k, v in ctx.timing.items()}
    if not d.weights.co_located:
        metrics["timing_s/update_weights"] = d.weights.sync_time
    epochs = d.stage_cfg.actor_update.ppo_epochs
    seq_lens = host.prompt_lengths + host.response_lengths
    metrics |= compute_perf_metrics(
        seq_lens, ctx.timing, d.n_devices, d.run.actor_model, epochs, d.peak_flops
    )
    if k := d.config.trainer.log_train_generations:
        scores = ctx.reward.scores  # (no filter_groups: these rows are ctx.prompts')
        metrics["train/generations"] = generation_samples(d.tokenizer, ctx.prompts, host, scores, k)
    return metrics


# ------------------------------------------------------------------------- host stages


def place_offloaded(stage: Stage, ctx: StepContext) -> None:
    """Before `stage`: the offloaded model states it uses (`Stage.uses`) on the devices, the
    other offloaded ones in host memory (`offload.misplaced`); timed as `timing_s/offload` and
    `timing_s/onload`, their bytes (summed over devices) in `perf/offload_bytes` and
    `perf/onload_bytes`. Nothing for a stage that declares no uses, or with no offload key.
    Host sync: waits for the copies."""
    offloaded = offloaded_states(ctx.deps.offload)
    if stage.uses is None or not offloaded:
        return
    away, back = misplaced(ctx.models, offloaded, stage.uses)
    for names, move, name in ((away, offload_to_host, "offload"), (back, load_to_device, "onload")):
        if names:
            with timed(ctx.timing, name):
                ctx.models, nbytes = move_states(ctx.models, names, move)
            key = f"perf/{name}_bytes"
            ctx.metrics[key] = ctx.metrics.get(key, 0.0) + float(nbytes)


def _sleep(batch, ctx: StepContext):
    """Releases the engine's KV pool (and its own weights) until the next rollout."""
    engine = ctx.deps.weights.engine
    ctx.metrics["perf/sleep_bytes"] = float(sleep_engine(engine, ctx.models.actor_state.params))
    return batch


def _gen(batch, ctx: StepContext):
    """Samples `rollout.n` responses per prompt of `ctx.prompts` (and, when the estimator asks
    for a baseline, one greedy response per prompt into `ctx.greedy`), or with a rollout
    thread takes the batch it sampled for this step (the stage's time is then the wait; the
    thread's generation time is `timing_s/rollout_gen`, the staleness `async/staleness_*`);
    sets `ctx.host`. With `rollout.multi_turn` the responses are multi-turn trajectories with
    tools (adds the `multi_turn/*` metrics)."""
    d = ctx.deps
    if d.rollout_ahead is None:
        batch, ctx.host, ctx.greedy = d.sampler.sample(ctx.prompts, ctx.step, ctx.gen_batches)
        ctx.gen_batches += 1
    else:
        rollout = d.rollout_ahead.take(ctx.step, ctx.timing)
        ctx.timing["rollout_gen"] = rollout.timing["gen"]
        ctx.timing["wait_update"] = rollout.timing["wait_update"]
        ctx.policy_versions, ctx.token_versions = rollout.versions, rollout.token_versions
        ctx.metrics |= staleness_metrics(rollout.versions, ctx.step, rollout.token_versions)
        ctx.prompts, batch, ctx.host, ctx.greedy = rollout.output
        ctx.scoring = rollout.scoring
    if d.multi_turn is not None:
        h = ctx.host
        ctx.metrics |= multi_turn_metrics(h.num_turns, h.tool_calls, h.tool_errors, h.row_mask)
    return batch


def _reward(batch, ctx: StepContext, baseline: bool = False):
    """Starts scoring (rule functions in threads, the reward model queued on the device), or
    takes the scoring the rollout thread started as soon as it generated the batch
    (`ctx.scoring`); the finish fills `token_level_scores` (and `reward_baselines`: each
    prompt's greedy score)."""
    reward = ctx.deps.reward
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
    """Re-lays the actor's weights out for generation (the hybrid engine), as policy version
    `ctx.step`."""
    weights = ctx.deps.weights
    nbytes = weights.update(ctx.models.actor_state.params, ctx.step)
    jax.block_until_ready(weights.engine.state)
    ctx.metrics["perf/reshard_bytes"] = float(nbytes)
    return batch


# ------------------------------------------------------------------------- device stages


def _old_log_prob_stage(batch, ctx: StepContext):
    m = ctx.models
    with pass_mesh(ctx.deps.run.meshes.train):
        batch, metrics = _old_log_prob(
            m.actor_graphdef, m.actor_state.params, batch, ctx.stage_config
        )
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
    sharding = ctx.deps.run.pool_batch_shardings.get(role)
    if sharding is None:
        return batch, ctx.stage_config
    rows = RLBatch(**{f: getattr(batch, f) for f in (*ROLLOUT, *fields)})
    return _to_pool(rows, sharding, ctx), ctx.deps.run.stage_config_of(role)


def _train_mesh(role: str, ctx: StepContext):
    """The training mesh a `role` pass runs on: its own pool's, else the actor's."""
    run = ctx.deps.run
    return run.role_meshes.get(role, run.meshes.train)


def _back(role: str, batch, ctx: StepContext, **outputs):
    """`batch` with the per-token `outputs` of a `role` pass, moved back to the actor's pool
    when the role has its own."""
    if role in ctx.deps.run.pool_batch_shardings:
        outputs = _to_pool(outputs, ctx.deps.run.batch_sharding, ctx)
    return batch.replace(**outputs)


def _ref_stage(batch, ctx: StepContext):
    m = ctx.models  # the frozen copy, or with LoRA the actor with its adapters off
    rows, sc = _rows_for("ref", batch, ctx)
    with pass_mesh(_train_mesh("ref", ctx)):
        out = _ref_log_prob(m.actor_graphdef, m.reference(), rows, sc)
    return _back("ref", batch, ctx, ref_log_prob=out.ref_log_prob)


def _teacher_stage(batch, ctx: StepContext):
    """The distillation teacher's log-probs of the sampled tokens, on its pool
    (`placement.teacher`)."""
    if ctx.models.teacher is None:
        raise ValueError("the teacher stage runs without a teacher model (distillation.enabled)")
    graphdef, params = ctx.models.teacher
    rows, sc = _rows_for("teacher", batch, ctx)
    with pass_mesh(_train_mesh("teacher", ctx)):
        out = _teacher_log_prob(graphdef, params, rows, sc)
    outputs = {f: getattr(out, f) for f in TEACHER_OUTPUTS if getattr(out, f) is not None}
    return _back("teacher", batch, ctx, **outputs)


def _values_stage(batch, ctx: StepContext):
    m = ctx.models
    rows, sc = _rows_for("critic", batch, ctx)
    with pass_mesh(_train_mesh("critic", ctx)):
        out = _values(m.critic_graphdef, m.critic_state.params, rows, sc)
    return _back("critic", batch, ctx, values=out.values)


def _adv_stage(batch, ctx: StepContext):
    batch, ctx.kl_coef, metrics = _advantage(batch, ctx.kl_coef, ctx.stage_config)
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
    with pass_mesh(_train_mesh("critic", ctx)):
        state, metrics, nan = _update_critic(m.critic_graphdef, m.critic_state, rows, _rng(ctx), sc)
    if "critic" in ctx.deps.run.pool_batch_shardings:  # scalars, summed with the actor's
        metrics, nan = jax.device_put((metrics, nan), ctx.deps.replicated)
    ctx.models = dataclasses.replace(m, critic_state=state)
    _record_update(ctx, metrics, nan)
    return batch


def _update_actor_stage(batch, ctx: StepContext):
    """The actor update, from step `trainer.critic_warmup + 1` on (the critic warms up first)."""
    if ctx.step <= ctx.config.trainer.critic_warmup:
        return batch
    m = ctx.models
    with pass_mesh(ctx.deps.run.meshes.train):
        state, metrics, nan = _update_actor(
            m.actor_graphdef, m.actor_state, batch, _rng(ctx), ctx.stage_config
        )
    ctx.models = dataclasses.replace(m, actor_state=state)
    _record_update(ctx, metrics, nan)
    return batch


# `uses`: the model states a stage reads; an offloaded one is on the devices only while a stage
# that uses it runs (`place_offloaded`). `gen` uses none (the rollout has its own weights), so
# every offloaded state leaves for it; stages that declare nothing leave them where they are
GEN = Stage("gen", _gen, writes=GENERATED, uses=())
SLEEP = Stage("sleep", _sleep)
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
    writes=("old_log_probs", "rollout_is_weights", "response_mask", "routed_experts"),
    uses=("actor",),
)
REF = Stage("ref", _ref_stage, reads=ROLLOUT, writes=("ref_log_prob",), uses=("ref",))
# the top-k log-probs and ids with distillation.topk
TEACHER_OUTPUTS = ("teacher_log_prob", "teacher_topk_log_probs", "teacher_topk_ids")
TEACHER = Stage("teacher", _teacher_stage, reads=ROLLOUT, writes=TEACHER_OUTPUTS, uses=("teacher",))
VALUES = Stage("values", _values_stage, reads=ROLLOUT, writes=("values",), uses=("critic",))
ADV = Stage(
    "adv",
    _adv_stage,
    reads=(*ROLLOUT, "token_level_scores"),
    writes=("token_level_rewards", "advantages", "returns"),
)
UPDATE_CRITIC = Stage(
    "update_critic",
    _update_critic_stage,
    reads=("values", "returns"),
    uses=("critic", "critic_optimizer"),
)
UPDATE_ACTOR = Stage(
    "update_actor",
    _update_actor_stage,
    reads=(*ROLLOUT, "advantages"),
    uses=("actor", "actor_optimizer"),
)
RESHARD = Stage("reshard", _reshard, uses=("actor",))
# every offloaded state back on the devices for what runs between steps (its `uses` does it)
ONLOAD = Stage("onload", lambda batch, ctx: batch, uses=MODEL_STATES)
