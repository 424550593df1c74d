"""The states a run keeps on the devices between stages, for the memory planner: every model
as abstract arrays on its mesh (`jax.ShapeDtypeStruct`s carrying their shardings; no weight is
materialised), and the bytes per device each holds, summed from shard shapes: parameters,
optimizer states, reference, teacher and reward models, the rollout's weights in the
generation layout and the KV page pool(s), sized as the engine sizes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from ml_collections import ConfigDict


def _with_shardings(tree: Any, shardings: Any) -> Any:
    fn = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return jax.tree.map(fn, tree, shardings)


def device_bytes(tree: Any) -> int:
    """Bytes of one device's shards of a pytree of sharded (abstract or concrete) arrays."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def abstract_model(model_cls, config, mesh, rules, dtype=None):
    """(graphdef, params as ShapeDtypeStructs with their shardings); nothing materialised."""
    from hybridjax.sharding import state_shardings

    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(config, nnx.Rngs(0))))
    if dtype is not None:  # the rollout's copy: floating leaves cast (update_weights)
        cast = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and dtype or x.dtype
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cast(x)), state)
    return graphdef, _with_shardings(state, state_shardings(state, mesh, rules))


def abstract_train_state(params: Any, optim) -> Any:
    """The TrainState the trainer builds (`build.train_state_shardings`), as abstract arrays."""
    from hybridjax.training import build

    shapes = jax.eval_shape(build.init_train_state, params, optim)
    return _with_shardings(shapes, build.train_state_shardings(params, optim))


def abstract_batch(
    rows: int, prompt: int, response: int, sharding, fields=(), topk: int = 0
) -> Any:
    """An RLBatch of ShapeDtypeStructs (rows over the batch axes), with the float B×R `fields`
    (and with `topk` > 0 the distillation teacher's B×R×topk log-probs and ids)."""
    from hybridjax.training.batch import RLBatch

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)
    batch = RLBatch(
        prompts=i32(rows, prompt),
        responses=i32(rows, response),
        response_mask=f32(rows, response),
        attention_mask=i32(rows, prompt + response),
        position_ids=i32(rows, prompt + response),
        rollout_log_probs=f32(rows, response),
        rollout_logit_threshold=f32(rows, response),  # single-turn rollouts record it
    )
    batch = batch.replace(**{name: f32(rows, response) for name in fields})
    if topk:
        k = (rows, response, topk)
        batch = batch.replace(teacher_topk_log_probs=f32(*k), teacher_topk_ids=i32(*k))
    return batch


def kv_pool(r, model, tp: int, capacity: int, in_use: int, stats: bool) -> tuple[int, int]:
    """(pages, bytes per page per device) of an engine with RolloutConfig `r` serving `model`
    (a ModelConfig) at tensor-parallel `tp`, as `rollout.programs.pool_pages` would choose
    them with `in_use` bytes already on the device."""
    from hybridjax.models.config import to_dtype

    kv = model.num_key_value_heads
    local = kv // tp if tp > 1 and kv % tp == 0 else kv
    itemsize = jnp.dtype(to_dtype(model.dtype)).itemsize
    page = 2 * model.num_hidden_layers * local * r.page_size * model.resolved_head_dim * itemsize
    if r.num_pages:
        pages = r.num_pages
    elif stats:
        from hybridjax.rollout.paged_cache import PagedKVCache

        free = dict(bytes_limit=capacity, bytes_in_use=in_use)
        pages = PagedKVCache.pages_from_memory([free], r.gpu_memory_utilization, page) or 1
    else:
        pages = r.default_num_pages
    return pages, page


@dataclasses.dataclass(frozen=True)
class ResidentStates:
    """A run's models as abstract arrays, and what each state holds between stages.

    `bytes`: name ("actor params", "KV pool", ...) → bytes per device. `*_def`: graphdefs;
    `actor_state`, `critic_state`: TrainStates; `gen_params`: the rollout's weights in the
    generation layout and `rollout.dtype` (`gen_dtype`); `rollout`: its RolloutConfig, with
    `pages` KV pages of `page` bytes per device. The critic, teacher and reward model are None
    when the run has none; `judge`: the reward model is a generative judge with an engine of
    its own (`judge_rollout`), else a classifier on the training mesh (`rm_def`).
    """

    bytes: dict[str, int]
    actor_def: Any
    actor_state: Any
    gen_params: Any
    gen_dtype: Any
    rollout: Any
    pages: int
    page: int
    critic_def: Any = None
    critic_state: Any = None
    critic_cfg: Any = None
    teacher_def: Any = None
    teacher: Any = None
    teacher_cfg: Any = None
    rm_def: Any = None
    rm: Any = None
    rm_cfg: Any = None
    judge: bool = False
    judge_rollout: Any = None


def resident_states(
    cfg: ConfigDict, run: Any, actor_config: Any, capacity: int, target: str
) -> ResidentStates:
    """The models of `run` (`config.run.resolve`) as abstract arrays on its meshes and the
    bytes per device each state holds: the KV pool sized from `rollout.num_pages`, else (on
    `target` "gpu") `gpu_memory_utilization` × (`capacity` − what is resident when the engine
    starts), else the CPU default; a judge's pool after the rollout's, as the trainer builds
    them."""
    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM, SequenceClassifier
    from hybridjax.models.hf_io import read_hf_config
    from hybridjax.rewards import genrm
    from hybridjax.rollout import RolloutConfig
    from hybridjax.rollout.config import run_batch_seqs
    from hybridjax.sharding import (
        ACTOR_GENERATE_RULES,
        ACTOR_TRAIN_RULES,
        CRITIC_RULES,
        REFERENCE_RULES,
        REWARD_MODEL_RULES,
    )
    from hybridjax.training import build

    train, gen = run.meshes.train, run.meshes.generate
    sc, roles = run.stage_cfg, run.roles
    a = cfg.actor_rollout_ref
    models: dict[str, Any] = {}
    actor_def, actor_params = abstract_model(CausalLM, actor_config, train, ACTOR_TRAIN_RULES)
    actor_state = abstract_train_state(actor_params, sc.actor_optim)
    resident = {
        "actor params": device_bytes(actor_state.params),
        "actor optimizer state": device_bytes(actor_state.opt_state),
    }
    if roles.reference:  # `build.frozen_copy`: in `ref.fsdp_config.model_dtype`
        ref_dtype = jnp.dtype(a.ref.fsdp_config.model_dtype)
        _, ref = abstract_model(CausalLM, actor_config, train, ACTOR_TRAIN_RULES, ref_dtype)
        resident["ref params"] = device_bytes(ref)
    if roles.critic:
        critic_cfg = build.critic_model_config(cfg, actor_config)
        critic_def, critic_params = abstract_model(
            SequenceClassifier, critic_cfg, train, CRITIC_RULES
        )
        critic_state = abstract_train_state(critic_params, sc.critic_optim)
        resident["critic params"] = device_bytes(critic_state.params)
        resident["critic optimizer state"] = device_bytes(critic_state.opt_state)
        models |= dict(critic_def=critic_def, critic_state=critic_state, critic_cfg=critic_cfg)
    if roles.teacher:  # `build.build_teacher`, on the reference's pool
        teacher_cfg = build.teacher_model_config(cfg, actor_config)
        teacher_def, teacher = abstract_model(CausalLM, teacher_cfg, train, REFERENCE_RULES)
        resident["teacher params"] = device_bytes(teacher)
        models |= dict(teacher_def=teacher_def, teacher=teacher, teacher_cfg=teacher_cfg)
    # a reward model here (a served one holds no device memory): a classifier in the training
    # mesh, or a generative judge (`build.build_judge`) on an engine of its own, generation layout
    judge = roles.reward_model and bool(cfg.reward_model.generative.enable)
    if roles.reward_model:
        rm_cfg = ModelConfig.from_hf_dict(read_hf_config(cfg.reward_model.model.path))
        rm_dtype = jnp.dtype(cfg.reward_model.model.dtype)
        if judge:
            rm_cfg = dataclasses.replace(rm_cfg, dtype=rm_dtype.name, param_dtype=rm_dtype.name)
            _, rm = abstract_model(CausalLM, rm_cfg, gen, ACTOR_GENERATE_RULES, rm_dtype)
            resident["judge params"] = device_bytes(rm)
        else:
            rm_def, rm = abstract_model(
                SequenceClassifier, rm_cfg, train, REWARD_MODEL_RULES, rm_dtype
            )
            resident["reward model params"] = device_bytes(rm)
            models["rm_def"] = rm_def
        models |= dict(rm=rm, rm_cfg=rm_cfg, judge=judge)
    param_dtype = jnp.dtype(actor_config.param_dtype)
    gen_dtype = jnp.dtype(a.rollout.dtype)
    _, gen_init = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES, param_dtype)
    _, gen_params = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES, gen_dtype)
    tp = gen.shape["tensor"]
    in_use = sum(resident.values()) + device_bytes(gen_init)
    r = RolloutConfig.from_config(a.rollout, run_batch_seqs(cfg))
    pages, page = kv_pool(r, actor_config, tp, capacity, in_use, target == "gpu")
    resident["rollout weights"] = device_bytes(gen_params)
    resident["KV pool"] = pages * page
    if judge:  # built after the rollout's engine: its pool takes a share of what is left
        jr = genrm.judge_engine_config(cfg.reward_model.generative)
        in_use = sum(resident.values())
        judge_pages, judge_page = kv_pool(jr, rm_cfg, tp, capacity, in_use, target == "gpu")
        resident["judge KV pool"] = judge_pages * judge_page
        models["judge_rollout"] = jr

    return ResidentStates(
        bytes=resident,
        actor_def=actor_def,
        actor_state=actor_state,
        gen_params=gen_params,
        gen_dtype=gen_dtype,
        rollout=r,
        pages=pages,
        page=page,
        **models,
    )


def on_devices(cfg: ConfigDict, states: ResidentStates) -> tuple[dict[str, int], dict[str, int]]:
    """(the states on the devices in `gen`, those in a training stage that does not use them),
    name → bytes per device. Offloaded states (`fsdp_config.*_offload`) are on the devices only
    in the stages that use them (`hybridjax.training.offload`). With `rollout.free_cache_engine` the
    engine sleeps after `gen` (`hybridjax.training.residency`): no pool or generation copy in
    training; a judge's engine holds its pool only while it judges
    (`generative.free_cache_engine`)."""
    from hybridjax.training.offload import offload_configs
    from hybridjax.training.residency import free_cache_engine

    resident = states.bytes
    offload = offload_configs(cfg)
    off = {
        "actor params": offload["actor"].param_offload,
        "actor optimizer state": offload["actor"].optimizer_offload,
        "ref params": offload["ref"].param_offload,
        "teacher params": offload["teacher"].param_offload,
        "critic params": offload["critic"].param_offload,
        "critic optimizer state": offload["critic"].optimizer_offload,
        "reward model params": bool(cfg.reward_model.model.fsdp_config.param_offload),
    }
    # the engine sleeps after gen (`trainer.residency`): no pool or generation copy in training;
    # the judge's engine holds its pool only while it judges (`generative.free_cache_engine`)
    asleep = ("KV pool", "rollout weights") if free_cache_engine(cfg) else ()
    judge_asleep = (
        ("judge KV pool",) if states.judge and cfg.reward_model.generative.free_cache_engine else ()
    )
    on_device = {k: v for k, v in resident.items() if not off.get(k) and k not in judge_asleep}
    training = {k: v for k, v in resident.items() if k not in asleep + judge_asleep}
    # offloaded states are on the devices only in the stages that use them (`training.offload`)
    idle = {k: v for k, v in training.items() if not off.get(k)}
    return on_device, idle
