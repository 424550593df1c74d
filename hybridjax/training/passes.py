"""The device stages of one RL step, each a pure function from batch to batch (+ metrics).

    compute_old_log_prob → compute_ref_log_prob → compute_teacher_log_prob → compute_values
        → compute_advantage → update_critic → update_actor

(generation and reward live in `trainer.rollout` and `hybridjax.rewards`: they touch the host.)
`compute_old_log_prob` is skipped when the actor update is on-policy
(`StageConfig.recompute_old_log_prob` False): `update_actor` then takes π_old from its own pass.
Each takes a frozen `StageConfig` and is jitted once by the trainer with the config and the
models' graph definitions static. Forward passes and updates run packed when the role's
`PackingConfig` is set (`hybridjax.models.packing`: no padding, the responses of a group
sharing one prompt copy, token-budget buffers), with outputs in the same B×R layout.
Algorithm choice happens inside the registries (`algorithm.adv_estimator`,
`actor.policy_loss.loss_mode`), never here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybridjax.algorithms.advantages import compute_advantage as estimate_advantage
from hybridjax.algorithms.config import (
    ActorLossConfig,
    AlgorithmConfig,
    CriticLossConfig,
    OverlongBufferConfig,
)
from hybridjax.algorithms.distillation import DistillationConfig, distillation_advantages
from hybridjax.algorithms.kl import apply_kl_penalty, update_kl_coef
from hybridjax.algorithms.loss_agg import LossCounts
from hybridjax.algorithms.losses import compute_actor_loss, compute_value_loss
from hybridjax.algorithms.overlong import apply_overlong_penalty
from hybridjax.algorithms.rollout_correction import (
    compute_rollout_importance_weights,
    mismatch_metrics,
    rollout_probs_diff_metrics,
    rollout_rejection,
)
from hybridjax.models.logprobs import LogProbConfig, log_probs_at
from hybridjax.models.lora import merged_model
from hybridjax.models.moe import RouterStats, with_router_stats
from hybridjax.models.packing import PackingConfig
from hybridjax.training.batch import RLBatch
from hybridjax.training.forward import (
    map_micro_batches,
    model_log_probs,
    model_log_probs_and_hidden,
    model_top_k,
    packed_map,
    response_log_probs,
    response_values,
)
from hybridjax.training.optim import OptimConfig, learning_rate, make_optimizer, set_learning_rate
from hybridjax.training.update import TrainState, UpdateConfig, ppo_update


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """Everything the device stages need, built once from the ConfigDict (hashable, static)."""

    temperature: float  # rollout temperature, applied to trainer log-probs
    group_size: int  # rollout.n
    log_prob_micro_batch_size: int  # rows per forward micro-batch, over all devices
    algorithm: AlgorithmConfig
    actor_loss: ActorLossConfig
    critic_loss: CriticLossConfig
    actor_update: UpdateConfig
    critic_update: UpdateConfig
    actor_optim: OptimConfig
    critic_optim: OptimConfig
    overlong: OverlongBufferConfig = OverlongBufferConfig()  # reward_model.overlong_buffer
    ref_log_prob_micro_batch_size: int = 0  # the reference pass's; 0: log_prob_micro_batch_size
    # False: no `old_log_prob` stage; the on-policy update takes π_old = stop_gradient(π_θ)
    recompute_old_log_prob: bool = True
    # packed forward passes (None: padded rows in micro-batches of log_prob_micro_batch_size)
    old_log_prob_packing: PackingConfig | None = None
    ref_packing: PackingConfig | None = None
    values_packing: PackingConfig | None = None
    head: LogProbConfig = LogProbConfig()  # LM head + log-softmax (fused by default)
    distillation: DistillationConfig = DistillationConfig()  # actor_rollout_ref.distillation
    # actor.moe_aux_loss_coeff: weight of the MoE router's load-balancing loss in the update
    moe_aux_loss_coeff: float = 0.0
    # actor.router_replay.mode: "R2" records each token's experts in the old_log_prob pass
    # (`routed_experts`) and the update replays them; "R3" replays the experts the rollout
    # engine recorded (`routed_experts` from the rollout) in the old_log_prob pass and the
    # update; "disabled" routes every pass afresh
    router_replay: str = "disabled"
    # rollout.log_prob_support resolved: the policy's passes (old_log_prob, update_actor)
    # score each token over the support it was sampled from (`rollout_logit_threshold`)
    replay_sampling_mask: bool = False


def group_ids(batch: RLBatch, cfg: StageConfig) -> jax.Array:
    """B int32: the prompt group of each row: the batch's per-row `uid` when it has one (groups
    of any size, in any order), else contiguous groups of `rollout.n` rows. Packing shares a
    prompt only between rows of one group whose prompt tokens are equal, so any grouping is
    exact; better groups only share more."""
    uid = getattr(batch, "uid", None)
    if uid is not None and jnp.issubdtype(jnp.asarray(uid).dtype, jnp.integer):
        return jnp.asarray(uid, jnp.int32)
    return jnp.arange(batch.batch_size, dtype=jnp.int32) // cfg.group_size


def _fields(batch: RLBatch, cfg: StageConfig, *names: str) -> dict[str, jax.Array]:
    base = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
        "group_ids": group_ids(batch, cfg),
    }
    return base | dict(zip(names, batch.require(*names), strict=True))


def _forward(
    fn,
    batch: RLBatch,
    cfg: StageConfig,
    packing: PackingConfig | None,
    micro: int = 0,
    names: tuple[str, ...] = (),
):
    """`fn(fields)` over the batch (with the batch fields `names` beside the base ones): packed
    buffers, or padded row micro-batches of `micro` rows (0: `log_prob_micro_batch_size`)."""
    fields = _fields(batch, cfg, *names)
    if packing is not None:
        return packed_map(fn, fields, fields["group_ids"], packing)
    return map_micro_batches(fn, fields, micro or cfg.log_prob_micro_batch_size)


def _log_probs(
    graphdef, params, batch: RLBatch, cfg: StageConfig, packing, micro=0, names=()
) -> jax.Array:
    fn = lambda f: response_log_probs(graphdef, params, f, cfg.temperature, head=cfg.head)[0]
    return _forward(fn, batch, cfg, packing, micro, names)


def _model(graphdef: nnx.GraphDef, params: Any) -> nnx.Module:
    """The merged model whose MoE layers `with_router_stats` records (a LoRA model's adapters
    merged into its base first: its `model` property builds a new module per call)."""
    return merged_model(nnx.merge(graphdef, params))


def _policy_names(cfg: StageConfig) -> tuple[str, ...]:
    """The batch fields every pass of the policy reads beyond the base ones: each token's
    sampled support with sampling-mask replay (`rollout.log_prob_support`)."""
    return ("rollout_logit_threshold",) if cfg.replay_sampling_mask else ()


def _log_probs_and_experts(
    graphdef, params, batch: RLBatch, cfg: StageConfig
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probs B×R and the experts every token used, B×(P+R)×L×k int32 (None for a dense
    model), in padded micro-batches of `log_prob_micro_batch_size` rows."""

    def fn(fields):
        forward = functools.partial(model_log_probs, temperature=cfg.temperature, head=cfg.head)
        (log_probs, _), router = with_router_stats(forward)(_model(graphdef, params), fields)
        ids = None if router is None else jnp.moveaxis(router.expert_ids, 0, 2)
        return log_probs, ids

    return _forward(fn, batch, cfg, None, names=_policy_names(cfg))


def compute_old_log_prob(
    graphdef: nnx.GraphDef, params: Any, batch: RLBatch, cfg: StageConfig
) -> tuple[RLBatch, dict[str, jax.Array]]:
    """Fills `old_log_probs` (B×R) with the current actor. When the rollout returned log-probs,
    reports their gap `training/rollout_probs_diff_{mean,max,std}` = |p_trainer − p_rollout|,
    and with `algorithm.rollout_is_threshold` set, the truncated importance weights
    π_old / π_rollout and their `mismatch/*` metrics. With `algorithm.rollout_is` the weights
    are kept as `rollout_is_weights` for the policy loss, and `mask` mode / the veto replace
    `response_mask` (verl's rejection sampling: dropped tokens leave every later stage).
    With `actor.router_replay.mode` "R2" the pass runs unpacked and also fills
    `routed_experts` with the experts every token used (a MoE actor), which the update then
    reuses; with "R3" it runs unpacked on the experts the rollout engine recorded
    (`routed_experts`, required), so π_old routes as the rollout did. With sampling-mask
    replay π_old is the policy truncated to each token's sampled support. The mismatch is
    reported every step (`rollout_corr/*`, `mismatch_metrics`), and an `algorithm.rollout_rs`
    entry of this stage (`icepop`, `sequence_mask`) drops tokens from `response_mask` and
    reweights the rest (`rollout_is_weights`, times the IS weights with `rollout_is`)."""
    mask, policy = batch.response_mask, _policy_names(cfg)
    if cfg.router_replay == "R2":  # record the experts for the update to replay
        old, routed = _log_probs_and_experts(graphdef, params, batch, cfg)
        batch = batch.replace(routed_experts=routed)
    elif cfg.router_replay == "R3":  # replay the rollout's experts
        old = _log_probs(graphdef, params, batch, cfg, None, names=("routed_experts", *policy))
    else:
        old = _log_probs(graphdef, params, batch, cfg, cfg.old_log_prob_packing, names=policy)
    old = old * mask
    batch, metrics, algo = batch.replace(old_log_probs=old), {}, cfg.algorithm
    if batch.rollout_log_probs is None:
        return batch, metrics
    metrics |= rollout_probs_diff_metrics(old, batch.rollout_log_probs, mask)
    metrics |= mismatch_metrics(old, batch.rollout_log_probs, mask)
    if algo.rollout_is_threshold is not None:
        weights, new_mask, m = compute_rollout_importance_weights(
            old, batch.rollout_log_probs, mask, algo
        )
        metrics |= m
        if algo.rollout_is:
            batch = batch.replace(rollout_is_weights=weights, response_mask=new_mask)
    if algo.rollout_rs_stage == "old_log_prob":
        log_ratio = old - batch.rollout_log_probs
        weights, new_mask, m = rollout_rejection(log_ratio, batch.response_mask, algo)
        if batch.rollout_is_weights is not None:
            weights = weights * batch.rollout_is_weights
        batch = batch.replace(rollout_is_weights=weights, response_mask=new_mask)
        metrics |= m
    return batch, metrics


def _frozen_log_probs(graphdef, params, batch: RLBatch, cfg: StageConfig) -> jax.Array:
    """B×R log-probs of a frozen model (reference or teacher) on the batch, masked: the
    reference pass's packing and micro-batches."""
    log_probs = _log_probs(
        graphdef, params, batch, cfg, cfg.ref_packing, cfg.ref_log_prob_micro_batch_size
    )
    return log_probs * batch.response_mask


def compute_ref_log_prob(
    graphdef: nnx.GraphDef, params: Any, batch: RLBatch, cfg: StageConfig
) -> RLBatch:
    """Fills `ref_log_prob` (B×R) with the frozen reference policy."""
    return batch.replace(ref_log_prob=_frozen_log_probs(graphdef, params, batch, cfg))


def compute_teacher_log_prob(
    graphdef: nnx.GraphDef, params: Any, batch: RLBatch, cfg: StageConfig
) -> RLBatch:
    """Fills `teacher_log_prob` (B×R float32, 0 outside `response_mask`) with the distillation
    teacher (`actor_rollout_ref.distillation.teacher_model`): log π_teacher(y_t | prefix) of the
    student's sampled tokens, at the rollout temperature, through the same packed, shared-prompt
    forward as the reference pass. The teacher's vocabulary must cover the student's tokens.
    With `distillation.topk` = k it also fills `teacher_topk_log_probs` (B×R×k float32, 0
    outside `response_mask`) and `teacher_topk_ids` (B×R×k int32): the teacher's k most likely
    next tokens at each response position, from the same forward, computed chunk by chunk
    from the head (`hybridjax.models.logprobs.top_k_log_probs`, no B×R×V array)."""
    distill = cfg.distillation
    if not distill.with_topk:
        return batch.replace(teacher_log_prob=_frozen_log_probs(graphdef, params, batch, cfg))

    def fn(fields):
        model = nnx.merge(graphdef, params)
        k, limit = distill.topk, distill.vocab_limit
        return model_top_k(model, fields, cfg.temperature, k, limit, cfg.head)

    micro = cfg.ref_log_prob_micro_batch_size
    log_probs, top, ids = _forward(fn, batch, cfg, cfg.ref_packing, micro)
    mask = batch.response_mask
    return batch.replace(
        teacher_log_prob=log_probs * mask,
        teacher_topk_log_probs=top * mask[..., None],
        teacher_topk_ids=ids * mask[..., None].astype(ids.dtype),
    )


def compute_values(
    graphdef: nnx.GraphDef, params: Any, batch: RLBatch, cfg: StageConfig
) -> RLBatch:
    """Fills `values` (B×R) with the critic."""
    fn = lambda f: response_values(graphdef, params, f)
    return batch.replace(values=_forward(fn, batch, cfg, cfg.values_packing))


def token_level_rewards(
    batch: RLBatch, kl_coef: jax.Array, cfg: StageConfig
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """token_level_scores (− β·KL when `algorithm.use_kl_in_reward`) (+ DAPO's overlong penalty
    at the last valid token when `reward_model.overlong_buffer.enable`, L_max = R).

    Returns (rewards B×R, next β from the KL controller, metrics): `actor/reward_kl_penalty`,
    `actor/reward_kl_penalty_coeff` and `actor/kl_coef` (β used this step) with KL in the
    reward; `reward/overlong_penalty/mean` and `reward/overlong_fraction` (share of responses
    penalised) with the overlong buffer."""
    (rewards,) = batch.require("token_level_scores")
    algo, overlong, metrics = cfg.algorithm, cfg.overlong, {}
    mask = batch.response_mask
    if algo.use_kl_in_reward:
        old, ref = batch.require("old_log_probs", "ref_log_prob")
        rewards, metrics = apply_kl_penalty(rewards, old, ref, mask, kl_coef, algo.kl_penalty)
        metrics["actor/kl_coef"] = metrics["actor/reward_kl_penalty_coeff"]
        kl_coef = update_kl_coef(
            kl_coef, metrics["actor/reward_kl_penalty"], batch.batch_size, algo.kl_ctrl
        )
    if overlong.enable:
        rewards, penalty_B = apply_overlong_penalty(
            rewards,
            mask,
            max_response_length=mask.shape[1],
            overlong_buffer_len=overlong.len,
            penalty_factor=overlong.penalty_factor,
        )
        metrics["reward/overlong_penalty/mean"] = jnp.mean(penalty_B)
        metrics["reward/overlong_fraction"] = jnp.mean((penalty_B < 0).astype(jnp.float32))
    return rewards, kl_coef, metrics


def compute_advantage(
    batch: RLBatch, kl_coef: jax.Array, cfg: StageConfig
) -> tuple[RLBatch, jax.Array, dict[str, jax.Array]]:
    """Token-level rewards (`token_level_rewards`), then the registered estimator's advantages
    and returns (with `values` and `reward_baselines` when those stages ran); with
    distillation, the advantages of `distillation_advantages` (π_old against
    `teacher_log_prob`; `distill/reverse_kl`). Returns (batch, next KL coefficient, metrics)."""
    rewards, kl_coef, metrics = token_level_rewards(batch, kl_coef, cfg)
    advantages, returns = estimate_advantage(
        rewards,
        batch.response_mask,
        config=cfg.algorithm,
        uid_B=batch.uid,
        values_BxT=batch.values,
        reward_baselines_B=batch.reward_baselines,
    )
    if cfg.distillation.as_reward:
        old, teacher = batch.require("old_log_probs", "teacher_log_prob")
        advantages, distill = distillation_advantages(
            advantages, old, teacher, batch.response_mask, cfg.distillation
        )
        metrics |= distill
    elif cfg.distillation.as_loss and not cfg.distillation.use_policy_loss:
        advantages = jnp.zeros_like(advantages)  # pure distillation: the loss term alone
    batch = batch.replace(token_level_rewards=rewards, advantages=advantages, returns=returns)
    return batch, kl_coef, metrics


def _actor_loss(graphdef, cfg: StageConfig, params, micro, counts):
    forward = functools.partial(
        model_log_probs_and_hidden, temperature=cfg.temperature, with_entropy=True, head=cfg.head
    )
    model = _model(graphdef, params)
    (log_prob, entropy, hidden), router = with_router_stats(forward)(model, micro)
    student_topk = None
    if cfg.distillation.with_topk:  # log π_θ at the teacher's top-k ids
        temperature = cfg.temperature if cfg.temperature > 0 else 1.0
        student_topk = log_probs_at(
            model, hidden, micro["teacher_topk_ids"], micro["responses"], log_prob, temperature
        )
    if cfg.actor_loss.entropy_coeff == 0:
        entropy = jax.lax.stop_gradient(entropy)  # a metric only: no backward through it
    rows, mask, rs_metrics = {}, micro["response_mask"], {}
    if cfg.algorithm.rollout_rs_stage == "update":  # e.g. DeepSeek-V3.2's sequence mask
        mask, rs_metrics = _masked_in_update(log_prob, micro, counts, cfg)
    if cfg.recompute_old_log_prob:
        old_log_prob = micro["old_log_probs"]
    else:  # on-policy: these parameters are π_old, so the ratio is exactly 1
        old_log_prob = jax.lax.stop_gradient(log_prob)
        if "rollout_log_probs" in micro:  # for the mismatch metrics of `update_actor`
            rows["old_log_probs"] = old_log_prob
    loss, metrics = compute_actor_loss(
        old_log_prob,
        log_prob,
        micro["advantages"],
        mask,
        config=cfg.actor_loss,
        counts=counts,
        entropy_BxT=entropy,
        ref_log_prob_BxT=micro.get("ref_log_prob"),
        rollout_is_weights_BxT=micro.get("rollout_is_weights"),
        teacher_log_prob_BxT=micro.get("teacher_log_prob"),
        distillation=cfg.distillation,
        topk_log_prob_BxTxK=student_topk,
        teacher_topk_log_prob_BxTxK=micro.get("teacher_topk_log_probs"),
    )
    metrics |= rs_metrics
    if router is not None:
        loss, router_metrics = _with_aux_loss(loss, router, micro, counts, cfg)
        metrics |= router_metrics
    return loss, (metrics, rows)


def _masked_in_update(log_prob, micro, counts: LossCounts, cfg: StageConfig):
    """The micro-batch's response mask after an update-stage `algorithm.rollout_rs` entry
    (ρ = π_θ / π_rollout, detached, and the advantages), and its metrics as shares of the
    mini-batch (the update sums micro-batch metrics); the loss keeps the mini-batch's
    denominators (TRL's masking)."""
    mask = micro["response_mask"]
    log_ratio = jax.lax.stop_gradient(log_prob) - micro["rollout_log_probs"]
    _, new_mask, m = rollout_rejection(log_ratio, mask, cfg.algorithm, micro["advantages"])
    tokens = jnp.sum(mask) / jnp.maximum(counts.num_tokens, 1.0)
    seqs = jnp.sum(jnp.any(mask > 0, -1)) / jnp.maximum(counts.num_seqs, 1.0)
    return new_mask, {k: v * (seqs if "seq_" in k else tokens) for k, v in m.items()}


def _with_aux_loss(loss, router: RouterStats, micro, counts: LossCounts, cfg: StageConfig):
    """loss + `moe_aux_loss_coeff` · this micro-batch's share of the router's load-balancing
    loss, and the `actor/moe_*` metrics as shares. The aux loss of a micro-batch is HF's over
    all its valid tokens (prompt and response); its share is its fraction of the mini-batch's
    response tokens, so the update's loss is the token-weighted mean of the micro-batches'
    aux losses (Megatron's per-micro-batch aux loss, averaged), and HF's exactly when the
    mini-batch is one micro-batch."""
    share = jnp.sum(micro["response_mask"]) / jnp.maximum(counts.num_tokens, 1.0)
    metrics = {f"actor/{k}": share * v for k, v in router.metrics().items()}
    if cfg.moe_aux_loss_coeff:
        loss = loss + cfg.moe_aux_loss_coeff * share * router.aux_loss()
    return loss, metrics


def _critic_loss(graphdef, cfg: StageConfig, params, micro, counts):
    vpreds = response_values(graphdef, params, micro)
    loss, metrics = compute_value_loss(
        vpreds,
        micro["returns"],
        micro["values"],
        micro["response_mask"],
        cliprange_value=cfg.critic_loss.cliprange_value,
        loss_agg_mode=cfg.critic_loss.loss_agg_mode,
        counts=counts,
        loss_scale_factor=cfg.critic_loss.loss_scale_factor,
    )
    return loss, (metrics, {})


def _update(role, loss, optim, update_cfg, state, fields, rng):
    lr = learning_rate(optim, state.step)
    state = dataclasses.replace(state, opt_state=set_learning_rate(state.opt_state, lr))
    state, raw, rows = ppo_update(state, fields, loss, make_optimizer(optim), update_cfg, rng)
    metrics = {k: v for k, v in raw.items() if "/" in k}
    metrics |= {
        f"{role}/grad_norm": raw["grad_norm"],
        f"{role}/lr": lr,
        f"{role}/nan_skipped_updates": raw["nan_steps"].astype(jnp.float32),
    }
    return state, metrics, raw["nan_steps"], rows


def update_actor(
    graphdef: nnx.GraphDef, state: TrainState, batch: RLBatch, rng: jax.Array, cfg: StageConfig
) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
    """PPO epochs over the batch with the registered policy loss (+ entropy and KL loss),
    each token's loss weighted by `rollout_is_weights` when `algorithm.rollout_is`.
    Returns (state, `actor/*` metrics, number of skipped non-finite updates).
    `actor/kl_coef` is `kl_loss_coef` with a KL loss, else 0 unless the adv stage reported
    the reward's β (KL in the reward).

    Without `cfg.recompute_old_log_prob` the update must be on-policy (one epoch, the batch
    one mini-batch): π_old is the update's own log-probs, detached, so `actor/ppo_kl` and
    `actor/pg_clipfrac` are exactly 0, and with rollout log-probs in the batch the
    `training/rollout_probs_diff_*` metrics come from those log-probs (= π_old) here.

    Raises:
      ValueError: no `old_log_probs` pass and the update is not one step on the whole batch.
    """
    use_kl_loss, recompute = cfg.actor_loss.use_kl_loss, cfg.recompute_old_log_prob
    update = cfg.actor_update
    if not recompute and (update.ppo_epochs != 1 or update.mini_batch_size != batch.batch_size):
        raise ValueError(
            f"no old_log_prob pass, but the update is not on-policy: ppo_epochs "
            f"{update.ppo_epochs}, mini-batch {update.mini_batch_size} of {batch.batch_size} rows"
        )
    with_rollout = not recompute and batch.rollout_log_probs is not None
    in_loss = cfg.algorithm.rollout_rs_stage == "update"
    names = ("old_log_probs",) if recompute else ()
    names += ("advantages",)
    names += ("ref_log_prob",) if use_kl_loss else ()
    names += ("rollout_is_weights",) if cfg.algorithm.uses_rollout_is_weights else ()
    names += ("rollout_log_probs",) if with_rollout or in_loss else ()
    names += _policy_names(cfg)
    names += ("teacher_log_prob",) if cfg.distillation.as_loss else ()
    names += ("teacher_topk_log_probs", "teacher_topk_ids") if cfg.distillation.with_topk else ()
    # R2 with a dense model recorded nothing (None); R3 requires the rollout's record
    replay = cfg.router_replay == "R3" or (
        cfg.router_replay == "R2" and batch.routed_experts is not None
    )
    names += ("routed_experts",) if replay else ()
    loss = functools.partial(_actor_loss, graphdef, cfg)
    state, metrics, nan, rows = _update(
        "actor", loss, cfg.actor_optim, cfg.actor_update, state, _fields(batch, cfg, *names), rng
    )
    if with_rollout:
        mask = batch.response_mask
        old = rows["old_log_probs"] * mask
        metrics |= rollout_probs_diff_metrics(old, batch.rollout_log_probs, mask)
        metrics |= mismatch_metrics(old, batch.rollout_log_probs, mask)
    if use_kl_loss or not cfg.algorithm.use_kl_in_reward:
        metrics["actor/kl_coef"] = jnp.float32(cfg.actor_loss.kl_loss_coef if use_kl_loss else 0)
    metrics.setdefault("actor/kl_loss", jnp.float32(0.0))
    return state, metrics, nan


def update_critic(
    graphdef: nnx.GraphDef, state: TrainState, batch: RLBatch, rng: jax.Array, cfg: StageConfig
) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
    """Clipped value-loss epochs over the batch. Returns (state, `critic/*` metrics, skipped)."""
    loss = functools.partial(_critic_loss, graphdef, cfg)
    fields = _fields(batch, cfg, "values", "returns")
    return _update("critic", loss, cfg.critic_optim, cfg.critic_update, state, fields, rng)[:3]
