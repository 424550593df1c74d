"""Turning the ConfigDict into the run's objects: tokenizer, model configs, sharded models, and
the frozen `StageConfig` the jitted stages take."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.algorithms.config import (
    ActorLossConfig,
    AlgorithmConfig,
    CriticLossConfig,
    OverlongBufferConfig,
)
from hybridjax.algorithms.distillation import DistillationConfig
from hybridjax.algorithms.registry import ROLLOUT_REJECTIONS
from hybridjax.models.config import AUTO_DTYPE, ModelConfig, auto_dtype
from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.models.hf_io import load_pretrained, model_config_from_checkpoint
from hybridjax.models.logprobs import LogProbConfig
from hybridjax.models.lora import (
    LoRAConfig,
    adapters_off,
    apply_lora,
    merge_trainable,
    split_trainable,
)
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.rewards.manager import overlong_enabled
from hybridjax.sharding import (
    ACTOR_TRAIN_RULES,
    CRITIC_RULES,
    REFERENCE_RULES,
    REWARD_MODEL_RULES,
    init_sharded,
    offload_to_host,
    sharding_fn,
    state_shardings,
)
from hybridjax.training.optim import OptimConfig, make_optimizer
from hybridjax.training.packing import attention_pair_cost, packing_configs
from hybridjax.training.passes import StageConfig
from hybridjax.training.update import TrainState, UpdateConfig


def dtype_of(name: str, backend: str | None = None) -> str:
    """`name`, or for `auto` the compute dtype of `backend` (default `jax.default_backend()`):
    bfloat16 on GPU and TPU, float32 on CPU (`hybridjax.models.config.auto_dtype`)."""
    if name != AUTO_DTYPE:
        return name
    return auto_dtype(jax.default_backend() if backend is None else backend)


def _fresh_train_state(params: Any, optim: OptimConfig) -> TrainState:
    trainable, _ = split_trainable(params)
    return TrainState(params, make_optimizer(optim).init(trainable), jnp.zeros((), jnp.int32))


init_train_state = jax.jit(_fresh_train_state, static_argnums=1)
init_train_state.__doc__ = """A fresh optimizer state for `params` (jitted; XLA picks the
optimizer state's layout: see `init_sharded_train_state`). With LoRA adapters in `params`, for
the adapters only (`split_trainable`): the base has no gradients and no optimizer state."""


def train_state_shardings(params: Any, optim: OptimConfig) -> TrainState:
    """Shardings of the TrainState `init_train_state` builds for `params` (arrays or abstract
    arrays with shardings): each optimizer leaf shaped like a trainable parameter (AdamW's
    moments) takes that parameter's sharding, the rest (step counts, the injected learning
    rate) is replicated. Left to XLA, the moments are replicated (they are zeros, with no data
    dependence on the sharded parameters): 2 × the trainable bytes on every device."""
    shardings = jax.tree.map(lambda x: x.sharding, params)
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())
    abstract = jax.eval_shape(init_train_state, params, optim)
    trainable, _ = split_trainable(shardings)
    opt = optax.tree_map_params(
        make_optimizer(optim),
        lambda _, sharding: sharding,
        abstract.opt_state,
        trainable,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(shardings, opt, replicated)


def init_sharded_train_state(params: Any, optim: OptimConfig) -> TrainState:
    """`init_train_state`, written straight into `train_state_shardings` (the trainer's)."""
    out = train_state_shardings(params, optim)
    return jax.jit(_fresh_train_state, static_argnums=1, out_shardings=out)(params, optim)


def load_tokenizer(cfg: ConfigDict) -> Tokenizer:
    """`data.tokenizer` if set, else the tokenizer of `actor_rollout_ref.model.path`."""
    return Tokenizer.from_pretrained(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path)


def scan_layers(value: str) -> bool | str:
    """`ModelConfig.scan_layers` from `actor_rollout_ref.model.scan_layers`: "true" / "false"
    as bools, "auto" kept (the config resolves it: on for dense models, off for MoE)."""
    return {"true": True, "false": False}.get(value, value)


def _overrides(cfg: ConfigDict) -> dict[str, Any]:
    model = cfg.actor_rollout_ref.model
    out = {
        "remat": model.enable_gradient_checkpointing,
        "remat_policy": model.remat_policy,
        "scan_layers": scan_layers(model.scan_layers),
        "dtype": dtype_of(model.dtype),
        "batch_invariant": model.batch_invariant,
    }
    return out | dict(model.override_config)


def actor_model_config(cfg: ConfigDict, tokenizer: Tokenizer | None) -> ModelConfig:
    """The actor's ModelConfig: `config.json` of `model.path` (or, when empty, a random model
    whose vocabulary and special tokens come from the tokenizer, which may be None only when
    `model.path` is set), then `override_config`."""
    path = cfg.actor_rollout_ref.model.path
    overrides = _overrides(cfg)
    if path:
        return model_config_from_checkpoint(path, **overrides)
    if tokenizer is None:
        raise ValueError("a random actor (no model.path) takes its vocabulary from a tokenizer")
    from_tokenizer = {
        "vocab_size": tokenizer.vocab_size,
        "eos_token_id": tokenizer.eos_token_ids or None,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    return ModelConfig(**(from_tokenizer | overrides))


def critic_model_config(cfg: ConfigDict, actor: ModelConfig) -> ModelConfig:
    """The critic's shape: the actor's with one output label and `critic.model.override_config`
    (never in parity mode: `model.batch_invariant` is about the actor's log-probs)."""
    overrides = {"num_labels": 1, "batch_invariant": False}
    return dataclasses.replace(actor, **overrides | dict(cfg.critic.model.override_config))


def build_actor(cfg: ConfigDict, config: ModelConfig, mesh, seed: int) -> CausalLM:
    """The actor in the training layout, never unsharded; with `model.lora_rank` > 0 wrapped
    in fresh LoRA adapters (`hybridjax.models.lora.LoRAModel`)."""
    path = cfg.actor_rollout_ref.model.path
    if path:
        overrides = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        actor = load_pretrained(
            path, shardings=sharding_fn(mesh, ACTOR_TRAIN_RULES), config_overrides=overrides
        )
    else:
        actor = init_sharded(CausalLM, config, mesh, ACTOR_TRAIN_RULES, seed)
    lora = LoRAConfig.from_config(cfg.actor_rollout_ref.model)
    return apply_lora(actor, lora, seed) if lora.enabled else actor


def build_critic(cfg: ConfigDict, config: ModelConfig, mesh, seed: int) -> SequenceClassifier:
    """The critic: `critic.model.path`, else the actor's checkpoint with a fresh value head,
    else a random model of the actor's shape; with `critic.model.lora_rank` > 0 wrapped in
    fresh LoRA adapters, the new value head trained in full (peft's `modules_to_save`)."""
    path = cfg.critic.model.path or cfg.actor_rollout_ref.model.path
    if path:
        names = ("remat", "remat_policy", "scan_layers", "dtype")
        overrides = {"num_labels": 1} | {name: getattr(config, name) for name in names}
        critic = load_pretrained(
            path,
            kind="classifier",
            shardings=sharding_fn(mesh, CRITIC_RULES),
            config_overrides=overrides | dict(cfg.critic.model.override_config),
            init_score_head=True,
            seed=seed,
        )
    else:
        critic = init_sharded(SequenceClassifier, config, mesh, CRITIC_RULES, seed)
    lora = LoRAConfig.from_config(cfg.critic.model, "critic.model")
    lora = dataclasses.replace(lora, modules_to_save=("score",))
    return apply_lora(critic, lora, seed) if lora.enabled else critic


def build_reward_model(cfg: ConfigDict, mesh) -> SequenceClassifier:
    """The reward model (`reward_model.model.path`, an HF `*ForSequenceClassification`),
    forward-only, in the reward-model layout of the training mesh."""
    dtype = dtype_of(cfg.reward_model.model.dtype)  # parameters and compute
    return load_pretrained(
        cfg.reward_model.model.path,
        kind="classifier",
        shardings=sharding_fn(mesh, REWARD_MODEL_RULES),
        config_overrides={"param_dtype": dtype, "dtype": dtype},
    )


def build_judge(cfg: ConfigDict, mesh, seed: int = 0):
    """A generative reward model's `score` (`reward_model.generative.enable` with a local
    `reward_model.model.path`, an HF `*ForCausalLM` with its tokenizer) on a paged engine of
    its own on `mesh`: the rollout's devices, or the reward model's pool
    (`placement.reward_model`). None when there is no local judge."""
    from hybridjax.rewards import genrm

    rm = cfg.reward_model
    if not (rm.enable and rm.generative.enable and rm.model.path):
        return None
    config = dataclasses.replace(genrm.JudgeConfig.from_dict(rm.generative), seed=seed)
    engine_config = genrm.judge_engine_config(rm.generative)
    dtype = dtype_of(rm.model.dtype)
    return genrm.load_judge(rm.model.path, config, engine_config, mesh, dtype).score


def teacher_model_config(cfg: ConfigDict, actor: ModelConfig) -> ModelConfig:
    """The distillation teacher's shape: `config.json` of
    `actor_rollout_ref.distillation.teacher_model.path` (in the actor's compute dtype), else the
    actor's; then `actor_rollout_ref.distillation.teacher_model.override_config`."""
    path = cfg.actor_rollout_ref.distillation.teacher_model.path
    overrides = dict(cfg.actor_rollout_ref.distillation.teacher_model.override_config)
    if path:
        return model_config_from_checkpoint(path, **({"dtype": actor.dtype} | overrides))
    return dataclasses.replace(actor, **overrides)


def build_teacher(cfg: ConfigDict, actor: ModelConfig, mesh) -> tuple[nnx.GraphDef, Any]:
    """The distillation teacher, forward only, in the reference layout of `mesh`, of the shape
    `teacher_model_config`: the checkpoint at `distillation.teacher_model.path` (an HF
    `*ForCausalLM` of any family we load), else a random model from `trainer.seed` (the
    student's own initial weights when nothing is overridden). Returns (graphdef, params).

    Raises:
      ValueError: the teacher's vocabulary is smaller than the student's (it could not score
        every sampled token).
    """
    config = teacher_model_config(cfg, actor)
    if config.vocab_size < actor.vocab_size:
        raise ValueError(
            f"actor_rollout_ref.distillation.teacher_model: vocab_size {config.vocab_size} "
            f"< the student's {actor.vocab_size}; the teacher must share the student's tokenizer"
        )
    path = cfg.actor_rollout_ref.distillation.teacher_model.path
    if path:
        overrides = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        teacher = load_pretrained(
            path, shardings=sharding_fn(mesh, REFERENCE_RULES), config_overrides=overrides
        )
    else:
        teacher = init_sharded(CausalLM, config, mesh, REFERENCE_RULES, cfg.trainer.seed)
    return nnx.split(teacher)


def forward_micro_batch(requested: int, rows: int, data_parallel: int) -> int:
    """Rows per micro-batch of a forward-only pass: the largest multiple of `data_parallel` that
    divides `rows` and is at most `requested` per device × `data_parallel` (at least one per
    device). `rows` is a multiple of `data_parallel` (validated)."""
    per_device = rows // data_parallel
    size = max(d for d in range(1, min(requested, per_device) + 1) if per_device % d == 0)
    return size * data_parallel


def batch_sizes(cfg: ConfigDict, data_parallel: int) -> dict[str, int]:
    """Rows (responses) per step, per actor/critic mini-batch and per micro-batch (all devices)."""
    a, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    rows = cfg.data.train_batch_size * n
    return {
        "batch": rows,
        "actor_mini": a.actor.ppo_mini_batch_size * n,
        "actor_micro": a.actor.ppo_micro_batch_size_per_gpu * data_parallel,
        "critic_mini": cfg.critic.ppo_mini_batch_size * n,
        "critic_micro": cfg.critic.ppo_micro_batch_size_per_gpu * data_parallel,
        "log_prob_micro": forward_micro_batch(
            a.rollout.log_prob_micro_batch_size_per_gpu, rows, data_parallel
        ),
        "ref_log_prob_micro": forward_micro_batch(
            a.ref.log_prob_micro_batch_size_per_gpu, rows, data_parallel
        ),
        "reward_micro": forward_micro_batch(
            cfg.reward_model.micro_batch_size_per_gpu, rows, data_parallel
        ),
    }


UNSET_WHEN_ZERO = (
    "rollout_is_threshold",
    "rollout_is_threshold_lower",
    "rollout_is_veto_threshold",
    "rollout_rs_threshold",
    "rollout_rs_threshold_lower",
)


def algorithm_config(cfg: ConfigDict) -> AlgorithmConfig:
    """`algorithm.*` as the frozen `AlgorithmConfig` (the config file's 0.0 = not set = None)."""
    values = cfg.algorithm.to_dict()
    for key in UNSET_WHEN_ZERO:
        if values.get(key, 0.0) <= 0:
            values[key] = None
    return AlgorithmConfig.from_dict(values)


def off_policy_reasons(cfg: ConfigDict) -> list[str]:
    """Why the actor update is not exactly on-policy; empty when it is. On-policy here means one
    optimizer step on the whole batch (`ppo_epochs` 1, one mini-batch; micro-batches only
    accumulate) with nothing reading π_old before the update: then the parameters of the
    `old_log_prob` pass are those the update starts from, so π_old equals the update's own
    log-probs, detached (TRL's and Tunix's shortcut; verl's actor notes it as `on_policy`)."""
    a, algo, bsz = cfg.actor_rollout_ref.actor, cfg.algorithm, cfg.data.train_batch_size
    reasons = []
    if a.ppo_epochs != 1:
        reasons.append(f"actor_rollout_ref.actor.ppo_epochs is {a.ppo_epochs}, not 1")
    if a.ppo_mini_batch_size != bsz:
        reasons.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({a.ppo_mini_batch_size}) differs from "
            f"data.train_batch_size ({bsz}): one optimizer step per mini-batch"
        )
    if algo.use_kl_in_reward:
        reasons.append("algorithm.use_kl_in_reward reads π_old in the adv stage, before the update")
    distill = cfg.actor_rollout_ref.distillation
    if distill.enabled and distill.loss_mode == "reward":
        reasons.append(
            "actor_rollout_ref.distillation.loss_mode='reward' reads π_old in the adv stage, "
            "before the update"
        )
    mode, lag = cfg.trainer.rollout_mode, cfg.trainer.staleness_threshold
    if mode == "one_step_off" or (mode == "async" and lag > 0):  # trainer/async_rollout.py
        reasons.append(f"trainer.rollout_mode={mode!r}: samples come from an older policy")
    if mode == "async" and cfg.trainer.partial_rollout:
        reasons.append("trainer.partial_rollout: carried tokens come from an older policy")
    if algo.rollout_is_threshold > 0:
        reasons.append(
            "algorithm.rollout_is_threshold is set: the rollout correction weighs by π_old "
            "before the update"
        )
    if algo.rollout_rs in ROLLOUT_REJECTIONS and ROLLOUT_REJECTIONS.get(algo.rollout_rs).stage == (
        "old_log_prob"
    ):
        reasons.append(f"algorithm.rollout_rs={algo.rollout_rs!r} masks by π_old before the update")
    return reasons


def replay_unsupported(cfg: ConfigDict) -> list[str]:
    """Why the rollout records no sampled supports for the trainer to replay (empty: it
    does): multi-turn and partial rollouts keep log-probs only."""
    reasons = []
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        reasons.append("multi-turn rollouts do not record the sampled supports")
    if cfg.trainer.rollout_mode == "async" and cfg.trainer.partial_rollout:
        reasons.append("partial rollouts do not record the sampled supports")
    return reasons


def replays_sampling_mask(cfg: ConfigDict) -> bool:
    """Whether the trainer scores the policy over each token's sampled support
    (`rollout.log_prob_support`): "replay" yes, "full" no, "auto" when sampling truncates
    (`do_sample` with `top_k` > 0 or `top_p` < 1) and the rollout records the supports."""
    r = cfg.actor_rollout_ref.rollout
    if r.log_prob_support != "auto":
        return r.log_prob_support == "replay"
    truncates = r.do_sample and r.temperature > 0 and (r.top_k > 0 or r.top_p < 1)
    return bool(truncates) and not replay_unsupported(cfg)


def recompute_old_log_prob(cfg: ConfigDict) -> bool:
    """Whether the `old_log_prob` stage runs: `actor.recompute_old_log_prob` "true" always,
    "false" never (validated to be on-policy, without routing replay), "auto" unless
    `off_policy_reasons` is empty and `actor.router_replay.mode` is not "R2" (which records
    the experts in that stage)."""
    a = cfg.actor_rollout_ref.actor
    mode = a.recompute_old_log_prob
    if mode == "auto":
        return bool(off_policy_reasons(cfg)) or a.router_replay.mode == "R2"
    return mode == "true"


def stage_config(
    cfg: ConfigDict,
    total_steps: int,
    data_parallel: int,
    actor: ModelConfig | None = None,
    mesh: Mesh | None = None,
) -> StageConfig:
    """The frozen config of the jitted stages (see `StageConfig`). `actor` sizes the packed
    buffer rows of every training-side pass (`trainer.packing.attention_pair_cost`; the
    critic is taken to be of the actor's shape); None: a whole group per row. `mesh`: the
    pool's training mesh, over which the fused LM head runs vocab-parallel
    (`LogProbConfig.mesh`); None: GSPMD partitions it."""
    a = cfg.actor_rollout_ref
    sizes = batch_sizes(cfg, data_parallel)
    pair_cost = attention_pair_cost(actor) if actor is not None else 0.0
    packed = packing_configs(cfg, data_parallel, pair_cost)
    actor_loss = dict(a.actor.to_dict())
    for key in ("loss_scale_factor", "clip_ratio_low", "clip_ratio_high"):  # 0: not set
        if actor_loss.get(key, 0) <= 0:
            actor_loss.pop(key, None)
    critic_loss = {k: v for k, v in cfg.critic.to_dict().items() if k != "loss_scale_factor"}
    return StageConfig(
        temperature=float(a.rollout.temperature) if a.rollout.do_sample else 1.0,
        group_size=a.rollout.n,
        log_prob_micro_batch_size=sizes["log_prob_micro"],
        ref_log_prob_micro_batch_size=sizes["ref_log_prob_micro"],
        algorithm=algorithm_config(cfg),
        overlong=OverlongBufferConfig.from_dict(
            dict(cfg.reward_model.overlong_buffer) | {"enable": overlong_enabled(cfg.reward_model)}
        ),
        actor_loss=ActorLossConfig.from_dict(actor_loss),
        critic_loss=CriticLossConfig.from_dict(critic_loss),
        actor_update=UpdateConfig(
            a.actor.ppo_epochs,
            sizes["actor_mini"],
            sizes["actor_micro"],
            a.actor.shuffle,
            packed["update_actor"],
        ),
        critic_update=UpdateConfig(
            cfg.critic.ppo_epochs,
            sizes["critic_mini"],
            sizes["critic_micro"],
            False,
            packed["update_critic"],
        ),
        actor_optim=OptimConfig.from_config(a.actor.optim, a.actor.grad_clip, total_steps),
        critic_optim=OptimConfig.from_config(cfg.critic.optim, cfg.critic.grad_clip, total_steps),
        recompute_old_log_prob=recompute_old_log_prob(cfg),
        replay_sampling_mask=replays_sampling_mask(cfg),
        moe_aux_loss_coeff=float(a.actor.moe_aux_loss_coeff),
        router_replay=a.actor.router_replay.mode,
        old_log_prob_packing=packed["old_log_prob"],
        ref_packing=packed["ref"],
        values_packing=packed["values"],
        distillation=dataclasses.replace(
            DistillationConfig.from_dict(a.distillation),
            vocab_limit=actor.vocab_size if actor is not None else 0,
        ),
        head=LogProbConfig(
            use_fused_kernels=a.model.use_fused_kernels,
            entropy_checkpointing=a.actor.entropy_checkpointing,
            entropy_from_logits_with_chunking=a.actor.entropy_from_logits_with_chunking,
            mesh=mesh,
        ),
    )


@dataclasses.dataclass(frozen=True)
class Models:
    """The run's models on the training mesh: graph definitions and initial states."""

    actor_graphdef: nnx.GraphDef
    actor_state: TrainState
    ref_params: Any | None  # a frozen copy of the actor's initial params (KL terms only)
    critic_graphdef: nnx.GraphDef | None
    critic_state: TrainState | None
    reward_model: tuple[nnx.GraphDef, Any] | None  # (graphdef, params), forward only
    ref_is_base: bool = False  # LoRA: the reference is the actor with adapters off
    teacher: tuple[nnx.GraphDef, Any] | None = None  # (graphdef, params): distillation teacher

    def reference(self) -> Any | None:
        """Parameters of the reference policy (None: no reference): the frozen copy, or with
        LoRA the actor's current state with its adapters off (the same arrays, no copy)."""
        if self.ref_is_base:
            return adapters_off(self.actor_state.params)
        return self.ref_params


def checkpointed(state: TrainState) -> TrainState:
    """What a checkpoint holds of a role: its state, or with LoRA only the adapters (and their
    optimizer state): the base never changes and is read from `model.path` again."""
    trainable, _ = split_trainable(state.params)
    return dataclasses.replace(state, params=trainable)


def restored(state: TrainState, saved: TrainState) -> TrainState:
    """Inverse of `checkpointed`: `saved` with the frozen base of `state` put back."""
    _, frozen = split_trainable(state.params)
    return dataclasses.replace(saved, params=merge_trainable(saved.params, frozen))


def frozen_copy(params: Any, cfg: ConfigDict) -> Any:
    """A copy of `params` (same shardings) for the reference model, floating leaves in
    `ref.fsdp_config.model_dtype` (verl's key: bfloat16 halves a frozen model's bytes)."""
    dtype = jnp.dtype(dtype_of(cfg.actor_rollout_ref.ref.fsdp_config.model_dtype))
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else jnp.copy(x), params)


def build_models(
    cfg: ConfigDict,
    actor_config: ModelConfig,
    mesh,
    stage: StageConfig,
    use_ref: bool,
    role_meshes: Mapping[str, Any] | None = None,
    critic_stage: StageConfig | None = None,
) -> Models:
    """Actor (+ reference copy, critic when `critic.enable`, reward model when
    `reward_model.enable`, distillation teacher when `distillation.enabled`) with fresh
    optimizer states, each in its training layout on `mesh`, or on `role_meshes[role]` (the
    training mesh of its own pool, `placement.<role>`) for `ref`, `teacher`, `critic`
    and `reward_model`. A reference on its own pool is a copy of the initial weights sent
    there (with LoRA: the base, adapters off; it never changes). `critic_stage`:
    the critic pool's `StageConfig` (default `stage`)."""
    seed, role_meshes = cfg.trainer.seed, dict(role_meshes or {})
    actor = build_actor(cfg, actor_config, mesh, seed)
    actor_graphdef, params = nnx.split(actor)
    critic_graphdef = critic_state = reward_model = None
    if cfg.critic.enable:
        critic_mesh = role_meshes.get("critic", mesh)
        critic = build_critic(cfg, critic_model_config(cfg, actor_config), critic_mesh, seed + 1)
        critic_graphdef, critic_params = nnx.split(critic)
        critic_state = init_sharded_train_state(critic_params, (critic_stage or stage).critic_optim)
    rm = cfg.reward_model  # a judge (`generative`) is built with the engines (`build_judge`)
    if rm.enable and rm.model.path and not rm.generative.enable:  # else served (remote.urls)
        graphdef, rm_params = nnx.split(
            build_reward_model(cfg, role_meshes.get("reward_model", mesh))
        )
        if rm.model.fsdp_config.param_offload:  # on the devices only while it scores
            rm_params = offload_to_host(rm_params)
        reward_model = (graphdef, rm_params)
    teacher = None
    if cfg.actor_rollout_ref.distillation.enabled:  # on its pool (placement.teacher)
        teacher = build_teacher(cfg, actor_config, role_meshes.get("teacher", mesh))
    lora = cfg.actor_rollout_ref.model.lora_rank > 0
    ref_params, ref_is_base = None, use_ref and lora
    if use_ref and "ref" in role_meshes:  # its own pool: a copy there (device to device)
        base = adapters_off(params)
        shardings = state_shardings(base, role_meshes["ref"], REFERENCE_RULES)
        ref_params, ref_is_base = frozen_copy(jax.device_put(base, shardings), cfg), False
    elif use_ref and not lora:
        ref_params = frozen_copy(params, cfg)
    return Models(
        actor_graphdef=actor_graphdef,
        actor_state=init_sharded_train_state(params, stage.actor_optim),
        ref_params=ref_params,
        critic_graphdef=critic_graphdef,
        critic_state=critic_state,
        reward_model=reward_model,
        ref_is_base=ref_is_base,
        teacher=teacher,
    )
