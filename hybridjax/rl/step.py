"""One RL step, `train_step(state, prompts, deps, n)`, in the order it runs:

    gen → sleep → reward → filter_groups → old_log_prob → ref → teacher → values → adv
        → update_critic → update_actor → reshard → onload

`train_step` is that order: each of its lines calls one stage function below with what the
stage reads and takes back what it changes (the batch, the models, the KL coefficient); the
stages add their timers (`timing_s/<stage>`) and metrics to the step's `Record`. `STAGES` is
the same list as data: `default_pipeline(cfg)` keeps the stages a config runs, and the
`trainer.stages` edits place the user's stages between them (`pipeline.Hooks`: a user's stage
placed after `reward` runs right after it, one that replaces `ref` runs instead of it). Left
out when the pipeline is built: `old_log_prob` unless the actor update is off-policy
(`build.recompute_old_log_prob`), `ref` without a KL term, `teacher` without on-policy
distillation (`actor_rollout_ref.distillation`), `values` and `update_critic` without a
critic, `filter_groups` (DAPO's dynamic sampling) unless `algorithm.filter_groups.enable`,
`sleep` (the engine's KV pool and own weights released after the rollout,
`hybridjax.training.residency`) unless `rollout.free_cache_engine`, and `onload` with no
offload key set. With DAPO, `sleep` runs after `filter_groups`, which samples more batches.
With an estimator that asks for a reward baseline (ReMax) `gen` also decodes each prompt
greedily and `reward` scores it. Which algorithm runs is the registries' business.

Before each stage that uses model states (`Stage.uses`), `place_offloaded` puts the offloaded
ones it uses on the devices and the others in host memory. Each device stage calls a jitted
pass of `hybridjax.training.passes`, compiled once per process and shared by every trainer
(graph definitions and `StageConfig` static). `reward` starts scoring and returns at once; the
scores are collected right before the first stage that reads `token_level_scores` (`adv`, or
DAPO's filter, or a user's stage), so scoring overlaps the log-prob and value passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from ml_collections import ConfigDict

from hybridjax.algorithms.advantages import ADV_ESTIMATORS, needs_reward_baseline
from hybridjax.metrics import compute_data_metrics, compute_perf_metrics
from hybridjax.rewards.manager import RewardResult
from hybridjax.rl.evaluation import generation_samples
from hybridjax.rl.generation import HostColumns
from hybridjax.rl.host_stages import (
    Sampled,
    Scoring,
    filter_groups,
    gen,
    onload,
    place_offloaded,
    reshard,
    sleep,
    start_reward,
)
from hybridjax.rl.pipeline import (
    MODEL_STATES,
    Deferred,
    Hooks,
    Pipeline,
    PipelineError,
    Record,
    Stage,
    StepContext,
    StepDeps,
    StepState,
    apply_entries,
    timed,
)
from hybridjax.sharding.layout import jit_keeping_state
from hybridjax.sharding.mesh import pass_mesh
from hybridjax.sharding.pools import move_rows
from hybridjax.sharding.roles import Roles
from hybridjax.training import passes
from hybridjax.training.batch import RLBatch
from hybridjax.training.build import Models, recompute_old_log_prob
from hybridjax.training.offload import any_offload, offload_configs
from hybridjax.training.residency import free_cache_engine

__all__ = [
    "STAGES",
    "Sampled",
    "Scoring",
    "StepContext",
    "StepDeps",
    "StepState",
    "default_pipeline",
    "place_offloaded",
    "train_step",
]

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
# the top-k log-probs and ids with distillation.topk
TEACHER_OUTPUTS = ("teacher_log_prob", "teacher_topk_log_probs", "teacher_topk_ids")

# The stages, in `train_step`'s order (`tests/rl/test_step_shape.py` checks it, and that the
# docs and the memory planner list them so). `uses`: the model states a stage reads; an
# offloaded one is on the devices only while a stage that uses it runs (`place_offloaded`).
# `gen` uses none (the rollout has its own weights), so every offloaded state leaves for it;
# stages that declare nothing leave them where they are.
GEN = Stage("gen", None, writes=GENERATED, uses=())
SLEEP = Stage("sleep", None)
REWARD = Stage("reward", None, reads=ROLLOUT, writes=("token_level_scores",))
REWARD_WITH_BASELINE = dataclasses.replace(
    REWARD, writes=("token_level_scores", "reward_baselines")
)  # the same stage, for an estimator with a reward baseline (ReMax)
FILTER_GROUPS = Stage(
    "filter_groups", None, reads=("uid", "token_level_scores", "response_mask"), writes=("uid",)
)
OLD_LOG_PROB = Stage(
    "old_log_prob",
    None,
    reads=ROLLOUT,
    writes=("old_log_probs", "rollout_is_weights", "response_mask", "routed_experts"),
    uses=("actor",),
)
REF = Stage("ref", None, reads=ROLLOUT, writes=("ref_log_prob",), uses=("ref",))
TEACHER = Stage("teacher", None, reads=ROLLOUT, writes=TEACHER_OUTPUTS, uses=("teacher",))
VALUES = Stage("values", None, reads=ROLLOUT, writes=("values",), uses=("critic",))
ADV = Stage(
    "adv",
    None,
    reads=(*ROLLOUT, "token_level_scores"),
    writes=("token_level_rewards", "advantages", "returns"),
)
UPDATE_CRITIC = Stage(
    "update_critic", None, reads=("values", "returns"), uses=("critic", "critic_optimizer")
)
UPDATE_ACTOR = Stage(
    "update_actor", None, reads=(*ROLLOUT, "advantages"), uses=("actor", "actor_optimizer")
)
RESHARD = Stage("reshard", None, uses=("actor",))
# every offloaded state back on the devices for what runs between steps
ONLOAD = Stage("onload", None, uses=MODEL_STATES)
STAGES = (GEN, SLEEP, REWARD, FILTER_GROUPS, OLD_LOG_PROB, REF, TEACHER, VALUES, ADV,
          UPDATE_CRITIC, UPDATE_ACTOR, RESHARD, ONLOAD)  # fmt: skip
DEFAULTS = (*STAGES, REWARD_WITH_BASELINE)


def default_pipeline(cfg: ConfigDict) -> Pipeline:
    """The stages of `STAGES` that `cfg` runs (the module docstring), before `trainer.stages`
    edits; with DAPO, `sleep` after `filter_groups`."""
    algo, roles = cfg.algorithm, Roles.from_config(cfg)
    dapo = algo.filter_groups.enable
    runs = {
        SLEEP: free_cache_engine(cfg),
        FILTER_GROUPS: dapo,
        OLD_LOG_PROB: recompute_old_log_prob(cfg),
        REF: roles.reference,
        TEACHER: roles.teacher,
        VALUES: roles.critic,
        UPDATE_CRITIC: roles.critic,
        ONLOAD: any_offload(offload_configs(cfg)),
    }
    stages = [s for s in STAGES if runs.get(s, True) and not (dapo and s is SLEEP)]
    if needs_reward_baseline(algo.adv_estimator):
        stages[stages.index(REWARD)] = REWARD_WITH_BASELINE
    if dapo and runs[SLEEP]:  # after the last generation batch
        stages.insert(stages.index(FILTER_GROUPS) + 1, SLEEP)
    return Pipeline(stages)


def configured_pipeline(cfg: ConfigDict) -> Pipeline:
    """`default_pipeline(cfg)` with the `trainer.stages` entries applied, checked.

    Raises:
      PipelineError: a bad entry, or a stage reading a field no earlier stage writes.
    """
    return check_order(apply_entries(default_pipeline(cfg), cfg.trainer.stages))


def check_order(pipeline: Pipeline) -> Pipeline:
    """`pipeline`, checked (`Pipeline.check`), its default stages in `train_step`'s order (with
    DAPO, `sleep` after `filter_groups`): `train_step` runs each only at its own place.

    Raises:
      PipelineError: a stage reads a field no earlier stage writes, or an edit moved a default
        stage.
    """
    pipeline.check()
    names = [s.name for s in pipeline.stages if any(s is d for d in DEFAULTS)]
    rank = {s.name: float(i) for i, s in enumerate(STAGES)}
    if FILTER_GROUPS.name in names:
        rank[SLEEP.name] = rank[FILTER_GROUPS.name] + 0.5
    if names != sorted(names, key=rank.__getitem__):
        raise PipelineError(
            f"the default stages run in the step's order ({', '.join(sorted(names, key=rank.get))}"
            f"), not as placed here ({pipeline}): add your own stage instead of moving one"
        )
    return pipeline


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


def train_step(
    state: StepState, prompts: dict[str, Any] | None, deps: StepDeps, n: int
) -> tuple[StepState, dict[str, Any], Sampled, RewardResult | None]:
    """RL step `n` on `prompts` (None: `gen` takes the batch the rollout thread sampled).

    Returns:
      (the new state, the step's metrics as host floats (timers `timing_s/<stage>`, `perf/*`,
      the stages' metrics, `nan_skipped`: skipped non-finite optimizer steps), the trained
      batch as sampled (host columns, prompts, policy versions), the rule reward's result).
    Host sync: each stage waits for its device work; metrics are pulled once at the end.
    """
    models, kl_coef, rec = state.models, state.kl_coef, Record()
    view = StepContext(n, deps, models, kl_coef, prompts, metrics=rec.metrics, timing=rec.timing)
    place = lambda models, uses: place_offloaded(models, uses, deps.offload, rec)
    user = Hooks(deps.pipeline, DEFAULTS, view, place)  # the user's stages, before each stage
    dapo, scoring = user.runs(FILTER_GROUPS), None

    def sample(prompts, k: int, models: Models):
        """gen → (sleep) → reward, the scoring left running: generation batch k of the step."""
        nonlocal scoring
        batch, models = user.before(GEN, None, models)
        models = place(models, GEN.uses)  # every offloaded state to host: the engine has its own
        sampled = gen(prompts, deps, n, rec, k)  # rollout.n responses per prompt (+ greedy ones)
        user.show(prompts=sampled.prompts, host=sampled.host, greedy=sampled.greedy, reward=None)
        batch = sampled.batch
        if user.runs(SLEEP) and not dapo:  # the KV pool freed until the next gen
            batch, models = user.before(SLEEP, batch, models)
            sleep(models, deps, rec)
        batch, models = user.before(REWARD, batch, models)
        if user.runs(REWARD):  # scored in threads; collected before the first reader
            scoring = start_reward(batch, sampled, deps, n, rec)
            user.defer(REWARD, Deferred(scoring.finish))
        return batch, sampled, models

    def resample(k: int) -> tuple[RLBatch, HostColumns, RewardResult | None]:
        """DAPO's next generation batch, scored."""
        nonlocal models
        batch, sampled, models = sample(next(deps.train_loader), k, models)
        batch, models = user.before(FILTER_GROUPS, batch, models)
        return batch, sampled.host, scoring and scoring.result

    with timed(rec.timing, "step"):
        batch, sampled, models = sample(prompts, 0, models)
        if dapo:  # generate again until groups vary
            batch, models = user.before(FILTER_GROUPS, batch, models)
            reward = scoring and scoring.result
            batch, host = filter_groups(batch, sampled.host, reward, deps, rec, resample)
            sampled = dataclasses.replace(sampled, host=host)
            user.show(host=host)
            if user.runs(SLEEP):
                batch, models = user.before(SLEEP, batch, models)
                sleep(models, deps, rec)
        batch, models = user.before(OLD_LOG_PROB, batch, models)
        if user.runs(OLD_LOG_PROB):  # π_old (off-policy updates only)
            models = place(models, OLD_LOG_PROB.uses)
            batch = old_log_prob(batch, models, deps, rec)
        batch, models = user.before(REF, batch, models)
        if user.runs(REF):  # π_ref (a KL term)
            models = place(models, REF.uses)
            batch = ref_log_prob(batch, models, deps, rec)
        batch, models = user.before(TEACHER, batch, models)
        if user.runs(TEACHER):  # π_teacher (on-policy distillation)
            models = place(models, TEACHER.uses)
            batch = teacher_log_prob(batch, models, deps, rec)
        batch, models = user.before(VALUES, batch, models)
        if user.runs(VALUES):  # V(s) (a critic)
            models = place(models, VALUES.uses)
            batch = values(batch, models, deps, rec)
        batch, models = user.before(ADV, batch, models)  # the scores are collected by now
        if user.runs(ADV):  # token rewards (KL penalty), advantages, returns
            batch, kl_coef = adv(batch, kl_coef, deps, rec)
            user.show(kl_coef=kl_coef)
        batch, models = user.before(UPDATE_CRITIC, batch, models)
        if user.runs(UPDATE_CRITIC):
            models = place(models, UPDATE_CRITIC.uses)
            models = update_critic(batch, models, deps, n, rec)
        batch, models = user.before(UPDATE_ACTOR, batch, models)
        if user.runs(UPDATE_ACTOR):
            models = place(models, UPDATE_ACTOR.uses)
            models = update_actor(batch, models, deps, n, rec)
        batch, models = user.before(RESHARD, batch, models)
        if user.runs(RESHARD):  # the new actor weights into the rollout engine
            models = place(models, RESHARD.uses)
            reshard(models, deps, n, rec)
        batch, models = user.before(ONLOAD, batch, models)
        if user.runs(ONLOAD):  # every offloaded state back on the devices between steps
            models = onload(models, deps, rec)
        batch, models = user.finish(batch, models)  # the user's stages after the last
        rec.metrics |= data_metrics(batch, deps.run.roles.critic)
        metrics = {k: float(v) for k, v in jax.device_get(rec.metrics).items()}  # host sync
    reward = scoring and scoring.result
    metrics |= _step_metrics(rec, deps, sampled, reward)
    return StepState(models, kl_coef), metrics, sampled, reward


def _step_metrics(
    rec: Record, deps: StepDeps, sampled: Sampled, reward: RewardResult | None
) -> dict[str, Any]:
    """The timers, `perf/*` and `train/generations` of a finished step."""
    metrics: dict[str, Any] = {f"timing_s/{k}": v for k, v in rec.timing.items()}
    if not deps.weights.co_located:
        metrics["timing_s/update_weights"] = deps.weights.sync_time
    epochs = deps.stage_cfg.actor_update.ppo_epochs
    host = sampled.host
    seq_lens = host.prompt_lengths + host.response_lengths
    metrics |= compute_perf_metrics(
        seq_lens, rec.timing, deps.n_devices, deps.run.actor_model, epochs, deps.peak_flops
    )
    if (k := deps.config.trainer.log_train_generations) and reward is not None:
        # (no filter_groups: these rows are the sampled prompts')
        metrics["train/generations"] = generation_samples(
            deps.tokenizer, sampled.prompts, host, reward.scores, k
        )
    return metrics


# ------------------------------------------------------------------------- device stages
# Each is timed as `timing_s/<stage>`, device work included (host sync at its end).


def old_log_prob(batch: RLBatch, models: Models, deps: StepDeps, rec: Record) -> RLBatch:
    """π_old of the sampled tokens (`old_log_probs`, and the rollout correction's weights)."""
    with timed(rec.timing, "old_log_prob"), pass_mesh(deps.run.meshes.train):
        graphdef, params = models.actor_graphdef, models.actor_state.params
        batch, metrics = _old_log_prob(graphdef, params, batch, deps.stage_cfg)
        rec.metrics |= metrics
        return _wait(batch, rec)


def ref_log_prob(batch: RLBatch, models: Models, deps: StepDeps, rec: Record) -> RLBatch:
    """π_ref of the sampled tokens (`ref_log_prob`): the frozen copy, or with LoRA the actor
    with its adapters off; on the reference's pool."""
    with timed(rec.timing, "ref"):
        rows, sc = _rows_for("ref", batch, deps, rec)
        with pass_mesh(_train_mesh("ref", deps)):
            out = _ref_log_prob(models.actor_graphdef, models.reference(), rows, sc)
        return _wait(_back("ref", batch, deps, rec, ref_log_prob=out.ref_log_prob), rec)


def teacher_log_prob(batch: RLBatch, models: Models, deps: StepDeps, rec: Record) -> RLBatch:
    """The distillation teacher's log-probs of the sampled tokens (`TEACHER_OUTPUTS`), on its
    pool (`placement.teacher`).

    Raises:
      ValueError: the models have no teacher.
    """
    if models.teacher is None:
        raise ValueError("the teacher stage runs without a teacher model (distillation.enabled)")
    with timed(rec.timing, "teacher"):
        graphdef, params = models.teacher
        rows, sc = _rows_for("teacher", batch, deps, rec)
        with pass_mesh(_train_mesh("teacher", deps)):
            out = _teacher_log_prob(graphdef, params, rows, sc)
        outputs = {f: getattr(out, f) for f in TEACHER_OUTPUTS if getattr(out, f) is not None}
        return _wait(_back("teacher", batch, deps, rec, **outputs), rec)


def values(batch: RLBatch, models: Models, deps: StepDeps, rec: Record) -> RLBatch:
    """The critic's V(s) per response token (`values`), on the critic's pool."""
    with timed(rec.timing, "values"):
        rows, sc = _rows_for("critic", batch, deps, rec)
        with pass_mesh(_train_mesh("critic", deps)):
            out = _values(models.critic_graphdef, models.critic_state.params, rows, sc)
        return _wait(_back("critic", batch, deps, rec, values=out.values), rec)


def adv(
    batch: RLBatch, kl_coef: jax.Array, deps: StepDeps, rec: Record
) -> tuple[RLBatch, jax.Array]:
    """Token rewards (the KL penalty), advantages and returns; the new adaptive KL coefficient."""
    with timed(rec.timing, "adv"):
        batch, kl_coef, metrics = _advantage(batch, kl_coef, deps.stage_cfg)
        rec.metrics |= metrics
        return _wait(batch, rec), kl_coef


def update_critic(batch: RLBatch, models: Models, deps: StepDeps, n: int, rec: Record) -> Models:
    """The critic's PPO value update on its pool; returns the models with its new state."""
    with timed(rec.timing, "update_critic"):
        rows, sc = _rows_for("critic", batch, deps, rec, "values", "returns")
        with pass_mesh(_train_mesh("critic", deps)):
            state, metrics, nan = _update_critic(
                models.critic_graphdef, models.critic_state, rows, _rng(deps, n), sc
            )
        if "critic" in deps.run.pool_batch_shardings:  # scalars, summed with the actor's
            metrics, nan = jax.device_put((metrics, nan), deps.replicated)
        _record_update(rec, metrics, nan)
        return dataclasses.replace(models, critic_state=_wait(state, rec))


def update_actor(batch: RLBatch, models: Models, deps: StepDeps, n: int, rec: Record) -> Models:
    """The actor's policy update, from step `trainer.critic_warmup + 1` on (the critic warms
    up first); returns the models with its new state."""
    with timed(rec.timing, "update_actor"):
        if n <= deps.config.trainer.critic_warmup:
            return models
        with pass_mesh(deps.run.meshes.train):
            state, metrics, nan = _update_actor(
                models.actor_graphdef, models.actor_state, batch, _rng(deps, n), deps.stage_cfg
            )
        _record_update(rec, metrics, nan)
        return dataclasses.replace(models, actor_state=_wait(state, rec))


def _wait(out, rec: Record):
    """`out` and the step's metrics so far, computed (the stage's time includes its work)."""
    jax.block_until_ready(rec.metrics)
    return jax.block_until_ready(out)


def _rng(deps: StepDeps, n: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(deps.config.trainer.seed), n)


def _record_update(rec: Record, metrics, nan_skipped) -> None:
    """Adds an update's metrics and its count of skipped non-finite optimizer steps."""
    rec.metrics |= metrics
    rec.count("nan_skipped", nan_skipped)


def _to_pool(rows, sharding, rec: Record):
    """`rows` moved into `sharding` (another pool's batch axes): device to device, timed as
    `timing_s/transfer` (within the stage's own time) and counted in `perf/transfer_bytes`.
    Host sync: waits for the copy, which the next pass needs anyway."""
    with timed(rec.timing, "transfer"):
        moved, nbytes = move_rows(rows, sharding)
        jax.block_until_ready(moved)
    rec.count("perf/transfer_bytes", nbytes)
    return moved


def _rows_for(role: str, batch: RLBatch, deps: StepDeps, rec: Record, *fields: str):
    """(the batch a `role` pass reads, its `StageConfig`): on the actor's pool `batch` itself;
    on the role's own pool a batch of the rollout fields and `fields`, moved there."""
    sharding = deps.run.pool_batch_shardings.get(role)
    if sharding is None:
        return batch, deps.stage_cfg
    rows = RLBatch(**{f: getattr(batch, f) for f in (*ROLLOUT, *fields)})
    return _to_pool(rows, sharding, rec), deps.run.stage_config_of(role)


def _train_mesh(role: str, deps: StepDeps):
    """The training mesh a `role` pass runs on: its own pool's, else the actor's."""
    return deps.run.role_meshes.get(role, deps.run.meshes.train)


def _back(role: str, batch: RLBatch, deps: StepDeps, rec: Record, **outputs) -> RLBatch:
    """`batch` with the per-token `outputs` of a `role` pass, moved back to the actor's pool
    when the role has its own."""
    if role in deps.run.pool_batch_shardings:
        outputs = _to_pool(outputs, deps.run.batch_sharding, rec)
    return batch.replace(**outputs)
