"""Memory planner: will a config fit the devices, before anything is placed on them?

    python -m hybridjax.plan --config=configs/gsm8k_grpo.py --devices=8 --device_memory_gb=80 \
        --config.actor_rollout_ref.model.path=configs/models/qwen2.5-7b

Every device stage of the RL step (`reward` with a reward model, `old_log_prob`, `ref`,
`teacher`, `values`, `update_critic`, `update_actor`) is lowered and compiled for the run's
training mesh from abstract inputs (`jax.ShapeDtypeStruct`s carrying their shardings; no
weight is materialised): XLA's memory analysis gives each program's outputs and donated
(aliased) bytes. The states every stage leaves resident (parameters, optimizer states,
reference and reward models, the rollout's weights in the generation layout, the KV page
pool, the batch) are summed from their shard shapes. What a stage allocates while it runs is
counted from shapes (`hybridjax.memory.counts`: gathered weights, activations, logits,
gradients, the optimizer step of one loop iteration). The peak of a stage is

    resident states + stage outputs − donated bytes + counted live bytes   (bytes per device)

XLA's CPU scratch of each program (`temp_size_in_bytes`) is kept beside it as
`xla_cpu_scratch_bytes`, not added: the CPU compiler fuses less than the GPU one and keeps
buffers a GPU program does not (for the 7B update, 181 GB of CPU scratch, mostly copies of
float32 logits and of the gathered embedding, against 29.6 GB counted).
`gen` adds the rollout's decode scratch (analytic: the logits, and the jnp path's gathered
K/V copy where it makes one). What `fsdp_config.*_offload` names is counted only in the stages
that use it (`hybridjax.rl.offload`: the actor in `old_log_prob`, `update_actor` and `reshard`, its
optimizer state in `update_actor`, the reference, teacher and critic in theirs). A generative
reward model (`reward_model.generative`) is planned as an engine of its own: its weights stay,
its KV pool (sized after the rollout's, as the trainer builds them) is on the devices only in
`reward`, beside its decode scratch, unless `generative.free_cache_engine` is off. The KV pool is
sized as the engine sizes it: `rollout.num_pages`, else `gpu_memory_utilization` × (capacity −
what is resident when the engine starts). With `rollout.free_cache_engine` (the default; sync
rollouts) the engine sleeps after `gen` (`hybridjax.rl.residency`): no training stage
holds the pool or the generation weights, and `reshard` writes the one new copy; without it
both stay through every stage and `reshard` holds a second copy while the new one lands.

The CLI compiles for `--devices` simulated CPU devices in its own process, so it runs anywhere
(docs/memory-planner.md: its error on CPU); with `--target=a100|h100` it compiles for
compile-only GPUs instead and adds XLA:GPU's bytes of every stage, the engine's programs and
the re-layout included (`MemoryPlan.xla_gpu`; docs/gpu-planning.md).
`trainer.check_memory=True` runs the same plan, without compiling (`compile_stages=False`), on
the run's own devices in the up-front config check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.memory.counts import LoopStep, stage_bytes
from hybridjax.memory.xla_gpu import (
    compile_on,
    memory_of,
    program_peak,
    relayout_scratch,
    resharded_leaves,
)
from hybridjax.models.logprobs import vocab_split
from hybridjax.sharding.layout import jit_keeping_state
from hybridjax.sharding.mesh import platform_of

log = logging.getLogger(__name__)
GB = 1e9


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Per-device bytes while one stage runs: `consumers` (name → bytes) sum to `peak`."""

    name: str
    consumers: dict[str, int]

    @property
    def peak(self) -> int:
        return sum(self.consumers.values())


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan of one config on `devices` devices of `capacity` bytes each."""

    devices: int
    capacity: int
    stages: tuple[StagePlan, ...]
    kv_pages: int
    kv_page_bytes: int  # one page over all layers, k and v, per device
    # full-length sequences the pool holds: all it runs with page_allocation "reserve"; with
    # "on_demand" (pages as sequences grow) a floor, shorter ones run beyond it
    full_sequences: int
    advice: tuple[str, ...]
    # stage → XLA's CPU memory analysis: scratch of the program compiled here (reference only:
    # the CPU compiler keeps buffers a GPU fusion does not; `hybridjax.memory.counts`)
    xla_cpu_scratch: dict[str, int] = dataclasses.field(default_factory=dict)
    # stage → XLA:GPU's bytes on compile-only GPUs (`memory.xla_gpu`): arguments, outputs,
    # aliased, scratch, the stage's peak from them, and for updates the resharded state leaves
    xla_gpu: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def fits(self) -> bool:
        """Every stage's counted peak, and XLA:GPU's where compiled, within capacity (and no
        program XLA:GPU could not compile)."""
        if any("error" in x for x in self.xla_gpu.values()):
            return False
        xla = max((x["peak"] for x in self.xla_gpu.values()), default=0)
        return max(self.worst.peak, xla) <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices,
            "capacity_bytes": self.capacity,
            "fits": self.fits,
            "worst_stage": self.worst.name,
            "kv_pages": self.kv_pages,
            "kv_page_bytes": self.kv_page_bytes,
            "kv_full_sequences": self.full_sequences,
            "stages": {s.name: {"peak_bytes": s.peak, **s.consumers} for s in self.stages},
            "xla_cpu_scratch_bytes": dict(self.xla_cpu_scratch),
            "xla_gpu": {k: dict(v) for k, v in self.xla_gpu.items()},
            "advice": list(self.advice),
        }

    def report(self) -> str:
        """A human-readable table: per-stage peak, verdict, largest consumers, what to change."""
        lines = [f"per-device memory on {self.devices} devices of {size(self.capacity)}:"]
        if self.xla_gpu:
            lines.append(f"  {'stage':<14} {'XLA:GPU':>10} {'counted':>10}  ratio")
        for s in self.stages:
            peak = self.xla_gpu.get(s.name, {}).get("peak", s.peak)
            mark = "" if max(peak, s.peak) <= self.capacity else "  <-- does not fit"
            if "error" in self.xla_gpu.get(s.name, {}):
                lines.append(f"  {s.name:<14} {'error':>10} {size(s.peak):>10}  (see below)")
            elif self.xla_gpu and s.name in self.xla_gpu:
                lines.append(
                    f"  {s.name:<14} {size(peak):>10} {size(s.peak):>10}  {peak / s.peak:.2f}{mark}"
                )
            elif self.xla_gpu:
                lines.append(f"  {s.name:<14} {'-':>10} {size(s.peak):>10}{mark}")
            else:
                lines.append(f"  {s.name:<14} {size(s.peak):>10}{mark}")
        w = self.worst
        verdict = "fits" if self.fits else "does NOT fit"
        for name, x in self.xla_gpu.items():
            if "error" in x:
                lines.append(f"XLA:GPU cannot compile {name}: {x['error']}")
        lines.append(
            f"{verdict}: peak {size(w.peak)} in {w.name} "
            f"({w.peak / self.capacity:.0%} of {size(self.capacity)})"
        )
        if peaks := {k: x["peak"] for k, x in self.xla_gpu.items() if "peak" in x}:
            worst = max(peaks, key=lambda k: peaks[k])
            lines.append(f"XLA:GPU's peak: {size(peaks[worst])} in {worst}")
        lines.append(f"largest consumers in {w.name}:")
        for name, b in sorted(w.consumers.items(), key=lambda kv: -kv[1])[:6]:
            lines.append(f"  {name:<28} {size(b):>10}")
        lines.append(
            f"KV pool: {self.kv_pages} pages of {self.kv_page_bytes / 1e6:.2f} MB "
            f"({self.full_sequences} full-length sequences)"
        )
        lines += [f"change: {a}" for a in self.advice]
        return "\n".join(lines)


# ------------------------------------------------------------------------------ abstract states


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
    from hybridjax.rl import build

    shapes = jax.eval_shape(build.init_train_state, params, optim)
    return _with_shardings(shapes, build.train_state_shardings(params, optim))


def abstract_batch(
    rows: int, prompt: int, response: int, sharding, fields=(), topk: int = 0
) -> Any:
    """An RLBatch of ShapeDtypeStructs (rows over the batch axes), with the float B×R `fields`
    (and with `topk` > 0 the distillation teacher's B×R×topk log-probs and ids)."""
    from hybridjax.rl.batch import RLBatch

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


# ------------------------------------------------------------------------------ the plan


def _kv_pool(r, model, tp: int, capacity: int, in_use: int, stats: bool) -> tuple[int, int]:
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


def _decode_scratch(actor, r, tp: int, impl: str) -> int:
    """Decode-loop scratch per device (an estimate; the engine is not compiled here): logits of
    the slots of its replica (`max_num_seqs` per data-parallel replica; float32, three copies
    for sampling) and, on the jnp path while it is at most `steps.MAX_GATHERED_BYTES`, the K/V
    of every slot gathered out of the pool at full width (`PagedKVCache.gathered`); beyond,
    and with the Pallas kernel, attention reads one block of pages at a time (small)."""
    from hybridjax.models.config import to_dtype
    from hybridjax.rollout.steps import MAX_GATHERED_BYTES

    slots = r.max_num_seqs
    logits = 3 * slots * -(-actor.vocab_size // tp) * 4
    kv = actor.num_key_value_heads
    local = kv // tp if tp > 1 and kv % tp == 0 else kv
    width = r.pages_per_seq * r.page_size
    itemsize = jnp.dtype(to_dtype(actor.dtype)).itemsize
    copy = 2 * actor.num_hidden_layers * slots * width * local * actor.resolved_head_dim * itemsize
    return logits + (copy if impl == "jnp" and copy <= MAX_GATHERED_BYTES else 0)


def plan_memory(
    cfg: ConfigDict,
    actor_config,
    devices: int | None = None,
    capacity_bytes: int | None = None,
    target: str = "gpu",
    compile_stages: bool = True,
    device_list: list[Any] | None = None,
) -> MemoryPlan:
    """Plans `cfg` on the first `devices` devices of this process (all by default).

    Args:
      cfg: a full trainer config (validated); its `auto` dtypes are resolved, in place, for
        `target` (`hybridjax.config.run.resolve_dtypes`: bfloat16 on GPU).
      actor_config: the actor's ModelConfig (`hybridjax.rl.build.actor_model_config`), built
        from `cfg` with its dtypes resolved for `target`.
      devices: how many of `jax.devices()` the meshes span.
      capacity_bytes: memory of one device; None = the device's `bytes_limit`, else (CPU) the
        host's physical memory split over its local devices.
      target: the backend the run will use, "gpu" (KV pool from gpu_memory_utilization,
        Pallas decode) or "cpu" (pool of max_num_seqs full sequences, jnp decode).
      compile_stages: compile every device stage for XLA's outputs, donated bytes and CPU
        scratch (seconds to many minutes for large models); False: outputs from shapes (a
        forward pass returns the batch plus one B×R float32 field; an update donates its
        state) and no `xla_cpu_scratch`. On compile-only GPUs (`device_list`) also the
        engine's prefill/extend/decode and the re-layout, into `MemoryPlan.xla_gpu`.
      device_list: the devices to plan on instead of `jax.devices()` (compile-only GPUs from
        `memory.gpu_targets.compile_only_devices`).
    Returns:
      the MemoryPlan.
    Raises:
      ValueError: fewer devices than `devices` (use the CLI, which simulates them).
    """
    from hybridjax.config.run import resolve, resolve_dtypes
    from hybridjax.memory.engine_programs import engine_memory
    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM, SequenceClassifier
    from hybridjax.models.hf_io import read_hf_config
    from hybridjax.rewards import genrm
    from hybridjax.rewards.reward_model import score_responses
    from hybridjax.rl import build, passes
    from hybridjax.rl.offload import offload_configs
    from hybridjax.rl.packing import packing_configs
    from hybridjax.rl.residency import free_cache_engine
    from hybridjax.rollout import RolloutConfig
    from hybridjax.sharding import (
        ACTOR_GENERATE_RULES,
        ACTOR_TRAIN_RULES,
        CRITIC_RULES,
        REFERENCE_RULES,
        REWARD_MODEL_RULES,
    )

    resolve_dtypes(cfg, target)
    available = device_list or jax.devices()
    devices = devices or len(available)
    if devices > len(available):
        raise ValueError(
            f"plan for {devices} devices, but this process has {len(available)}; run "
            f"`python -m hybridjax.plan --devices={devices}` (simulated CPU devices)"
        )
    capacity = capacity_bytes or device_capacity(available[0], len(jax.local_devices()))
    # the run as the trainer resolves it (one step per epoch: the schedule does not size memory)
    run = resolve(cfg, actor_config, 1, available[:devices])
    train, gen = run.meshes.train, run.meshes.generate
    dp, sc, roles = run.data_parallel, run.stage_cfg, run.roles
    use_ref = roles.reference
    a = cfg.actor_rollout_ref

    actor_def, actor_params = abstract_model(CausalLM, actor_config, train, ACTOR_TRAIN_RULES)
    actor_state = abstract_train_state(actor_params, sc.actor_optim)
    resident = {
        "actor params": device_bytes(actor_state.params),
        "actor optimizer state": device_bytes(actor_state.opt_state),
    }
    if use_ref:  # `build.frozen_copy`: in `ref.fsdp_config.model_dtype`
        ref_dtype = jnp.dtype(a.ref.fsdp_config.model_dtype)
        _, ref = abstract_model(CausalLM, actor_config, train, ACTOR_TRAIN_RULES, ref_dtype)
        resident["ref params"] = device_bytes(ref)
    critic_def = critic_state = None
    if roles.critic:
        critic_cfg = build.critic_model_config(cfg, actor_config)
        critic_def, critic_params = abstract_model(
            SequenceClassifier, critic_cfg, train, CRITIC_RULES
        )
        critic_state = abstract_train_state(critic_params, sc.critic_optim)
        resident["critic params"] = device_bytes(critic_state.params)
        resident["critic optimizer state"] = device_bytes(critic_state.opt_state)
    if roles.teacher:  # `build.build_teacher`, on the reference's pool
        teacher_cfg = build.teacher_model_config(cfg, actor_config)
        teacher_def, teacher = abstract_model(CausalLM, teacher_cfg, train, REFERENCE_RULES)
        resident["teacher params"] = device_bytes(teacher)
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
    param_dtype = jnp.dtype(actor_config.param_dtype)
    gen_dtype = jnp.dtype(a.rollout.dtype)
    _, gen_init = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES, param_dtype)
    _, gen_params = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES, gen_dtype)
    tp = gen.shape["tensor"]
    in_use = sum(resident.values()) + device_bytes(gen_init)
    r = RolloutConfig.from_config(a.rollout)
    pages, page = _kv_pool(r, actor_config, tp, capacity, in_use, target == "gpu")
    resident["rollout weights"] = device_bytes(gen_params)
    resident["KV pool"] = pages * page
    if judge:  # built after the rollout's engine: its pool takes a share of what is left
        jr = genrm.judge_engine_config(cfg.reward_model.generative)
        in_use = sum(resident.values())
        judge_pages, judge_page = _kv_pool(jr, rm_cfg, tp, capacity, in_use, target == "gpu")
        resident["judge KV pool"] = judge_pages * judge_page

    rows = cfg.data.train_batch_size * a.rollout.n
    prompt, response = cfg.data.max_prompt_length, r.response_length
    sharding = run.batch_sharding
    forward_batch = abstract_batch(rows, prompt, response, sharding)
    fields = ["advantages", "returns", "token_level_scores", "token_level_rewards"]
    fields += ["old_log_probs"] * sc.recompute_old_log_prob + ["ref_log_prob"] * use_ref
    fields += ["values"] * roles.critic + ["rollout_is_weights"] * sc.algorithm.rollout_is
    fields += ["teacher_log_prob"] * sc.distillation.as_loss
    topk = sc.distillation.topk if sc.distillation.with_topk else 0
    update_batch = abstract_batch(rows, prompt, response, sharding, fields, topk)
    if sc.router_replay != "disabled" and actor_config.num_experts:  # the replayed experts
        layers = sum(map(actor_config.is_moe_layer, range(actor_config.num_hidden_layers)))
        shape = (rows, prompt + response, layers, actor_config.num_experts_per_tok)
        routed = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        update_batch = update_batch.replace(routed_experts=routed)
        if sc.router_replay == "R3":  # recorded by the rollout, read by old_log_prob too
            forward_batch = forward_batch.replace(routed_experts=routed)
    key_dtype = jax.eval_shape(jax.random.key, 0).dtype
    rng = jax.ShapeDtypeStruct((), key_dtype, sharding=NamedSharding(train, PartitionSpec()))
    forward = lambda f: jax.jit(f, static_argnums=(0, 3))
    updater = lambda f: jit_keeping_state(f, static_argnums=(0, 4), state_argnum=1)  # as rl.step

    plans, xla_scratch, xla_gpu = [], {}, {}  # type: ignore[var-annotated]
    on_gpu = compile_stages and platform_of(available[:devices]) == "gpu"  # compile-only GPUs
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
        ("judge KV pool",) if judge and cfg.reward_model.generative.free_cache_engine else ()
    )
    on_device = {k: v for k, v in resident.items() if not off.get(k) and k not in judge_asleep}
    from hybridjax.rollout.decode_attention import select_decode_kernel  # noqa: PLC0415

    impl = select_decode_kernel(
        r.attention_impl, actor_config.sliding_window, target, actor_config.resolved_head_dim,
        r.page_size,
    )  # fmt: skip
    decode = _decode_scratch(actor_config, r, tp, impl)
    plans.append(StagePlan("gen", on_device | {f"decode scratch ({impl})": decode}))
    if on_gpu:  # the engine's programs; their arguments hold the rollout weights and pool
        gen_def = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES)[0]
        programs = engine_memory(gen_def, gen_params, actor_config, a.rollout, gen, pages)
        rest = sum(v for k, v in on_device.items() if k not in ("rollout weights", "KV pool"))
        worst = max(programs, key=lambda k: program_peak(programs[k]))
        xla_gpu["gen"] = programs[worst] | {"peak": rest + program_peak(programs[worst])}
        xla_gpu["gen"] |= {f"{k} peak": program_peak(v) for k, v in programs.items()}

    training = {k: v for k, v in resident.items() if k not in asleep + judge_asleep}
    # offloaded states are on the devices only in the stages that use them (`rl.offload`)
    idle = {k: v for k, v in training.items() if not off.get(k)}
    fused = target == "gpu"  # the blocked attention (`models.attention.attention_backend`)
    mesh_shape = dict(train.shape)

    def stage(name, fn, args, batch, used, count):
        others = {k: v for k, v in idle.items() if k not in used}
        m: dict[str, int] = {}
        if compile_stages:  # under the mesh, as the step runs it (MoE experts in shard_map)
            compiled, failed = compile_on(train, fn, args, catch=on_gpu)
            if failed:  # XLA:GPU could not compile it: reported, counted from shapes
                xla_gpu[name] = {"error": failed}  # type: ignore[dict-item]
        if compile_stages and not failed:
            m = memory_of(compiled)
            if on_gpu:
                xla_gpu[name] = m | {"peak": sum(others.values()) + program_peak(m)}
                if name.startswith("update"):
                    xla_gpu[name]["resharded_leaves"] = len(resharded_leaves(compiled, args[1]))
            else:
                xla_scratch[name] = m["scratch"]
            outputs = m["outputs"] - m["aliased"]
        if not m:  # see the docstring
            updates = name.startswith("update")
            outputs = 0 if updates else device_bytes(batch) + rows * response * 4 // dp
            m = {"outputs": outputs}
        mine = {k: resident[k] for k in used} | {"batch": device_bytes(batch)}
        new = {f"{name} outputs": outputs}
        new |= {f"{name} {k}": v for k, v in count.items()}
        plans.append(StagePlan(name, others | mine | new))
        log.info("planned %s: XLA %s, counted %s", name, m, count)

    def count(kind, model_cfg, state, packing, micro_rows, head=True):
        step = LoopStep.of(packing, max(micro_rows // dp, 1), prompt, response)
        params = state.params if kind == "update" else state
        opt = device_bytes(state.opt_state) if kind == "update" else 0
        attention = "fused" if fused else "jnp"
        chunk = sc.head.chunk_size if sc.head.use_fused_kernels else 0
        split = vocab_split(sc.head.mesh, model_cfg.vocab_size, step.rows)
        vocab_axes = split[1] if split else ()
        args = (kind, model_cfg, params, mesh_shape, step, attention, head, opt, chunk)
        return stage_bytes(*args, vocab_axes=vocab_axes)

    if judge:  # generation: its pool (awake again) and its decode loop's scratch
        j_impl = select_decode_kernel(
            r.attention_impl, rm_cfg.sliding_window, target, rm_cfg.resolved_head_dim, jr.page_size
        )
        scratch = {f"reward decode scratch ({j_impl})": _decode_scratch(rm_cfg, jr, tp, j_impl)}
        pool = {"judge KV pool": resident["judge KV pool"]}
        plans.append(StagePlan("reward", idle | pool | scratch))
    elif roles.reward_model:  # `RewardStage.submit`: `score_responses` on the training mesh
        rm_packing = packing_configs(cfg, dp)["reward_model"]
        rm_micro = build.forward_micro_batch(cfg.reward_model.micro_batch_size_per_gpu, rows, dp)
        prompt_mask = forward_batch.prompts  # B×P int32, as the prompt ids
        args = (rm_def, rm, forward_batch.prompts, prompt_mask, forward_batch.responses)
        args += (forward_batch.response_mask, rm_micro, rm_packing)
        c = count("forward", rm_cfg, rm, rm_packing, rm_micro, False)
        stage("reward", score_responses, args, forward_batch, ["reward model params"], c)
    log_micro = sc.log_prob_micro_batch_size
    if sc.recompute_old_log_prob:
        args = (actor_def, actor_state.params, forward_batch, sc)
        c = count("forward", actor_config, actor_state.params, sc.old_log_prob_packing, log_micro)
        fn = forward(passes.compute_old_log_prob)
        stage("old_log_prob", fn, args, forward_batch, ["actor params"], c)
    if use_ref:
        args = (actor_def, actor_state.params, forward_batch, sc)
        micro = sc.ref_log_prob_micro_batch_size or log_micro
        c = count("forward", actor_config, actor_state.params, sc.ref_packing, micro)
        fn = forward(passes.compute_ref_log_prob)
        stage("ref", fn, args, forward_batch, ["ref params"], c)
    if roles.teacher:  # the reference's forward, with the teacher's weights
        args = (teacher_def, teacher, forward_batch, sc)
        micro = sc.ref_log_prob_micro_batch_size or log_micro
        c = count("forward", teacher_cfg, teacher, sc.ref_packing, micro)
        fn = forward(passes.compute_teacher_log_prob)
        stage("teacher", fn, args, forward_batch, ["teacher params"], c)
    if critic_state is not None:
        args = (critic_def, critic_state.params, forward_batch, sc)
        c = count("forward", critic_cfg, critic_state.params, sc.values_packing, log_micro, False)
        stage("values", forward(passes.compute_values), args, forward_batch, ["critic params"], c)
        args = (critic_def, critic_state, update_batch, rng, sc)
        used = ["critic params", "critic optimizer state"]
        u = sc.critic_update
        c = count("update", critic_cfg, critic_state, u.packing, u.micro_batch_size, False)
        stage("update_critic", updater(passes.update_critic), args, update_batch, used, c)
    args = (actor_def, actor_state, update_batch, rng, sc)
    used = ["actor params", "actor optimizer state"]
    u = sc.actor_update
    c = count("update", actor_config, actor_state, u.packing, u.micro_batch_size)
    stage("update_actor", updater(passes.update_actor), args, update_batch, used, c)
    largest_leaf = max(device_bytes(x) for x in jax.tree.leaves(gen_params))
    reshard = {"new rollout weights": resident["rollout weights"], "one leaf scratch": largest_leaf}
    actor = {"actor params": resident["actor params"]}
    plans.append(StagePlan("reshard", idle | actor | reshard))
    if on_gpu:  # one leaf moved at a time (`update_weights`): the worst leaf's XLA scratch
        targets = jax.tree.map(lambda x: x.sharding, gen_params)
        moved = relayout_scratch(actor_state.params, targets, gen_dtype)
        peak = sum((idle | actor).values()) + resident["rollout weights"] + moved
        xla_gpu["reshard"] = {"scratch": moved, "peak": peak}

    full = pages // max(r.pages_per_seq, 1)
    plan = MemoryPlan(devices, capacity, tuple(plans), pages, page, full, (), xla_scratch, xla_gpu)
    return dataclasses.replace(plan, advice=tuple(advise(plan, cfg, train, devices)))


def device_capacity(device, local_devices: int) -> int:
    """Bytes one device may use: its `bytes_limit`, else (CPU) physical memory / local devices."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_devices


def size(nbytes: float) -> str:
    """`1.23 GB` (10^9 bytes) from 1 GB up, else `45.6 MB`."""
    return f"{nbytes / GB:.2f} GB" if abs(nbytes) >= GB else f"{nbytes / 1e6:.1f} MB"


def advise(plan: MemoryPlan, cfg: ConfigDict, train_mesh, devices: int) -> list[str]:
    """What to change: for each stage over capacity, worst first, the keys that shrink its
    largest consumers (each key once); and a KV pool too small for `max_num_seqs`."""
    a, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    out: dict[str, str] = {}
    if plan.full_sequences < r.max_num_seqs:
        # "reserve" books each sequence's full length at admission, so slots past the pool's
        # full-length count stay empty; "on_demand" runs them while short and preempts
        # (recomputes) the youngest when they grow, so the count is a bound on the waste only
        on_demand = r.get("page_allocation", "on_demand") == "on_demand"
        effect = (
            "sequences past that many are preempted and recomputed as they grow"
            if on_demand
            else "slots wait for pages"
        )
        out["rollout.max_num_seqs"] = (
            f"the KV pool holds {plan.full_sequences} full-length sequences but "
            f"rollout.max_num_seqs is {r.max_num_seqs}: {effect}; raise "
            "rollout.gpu_memory_utilization or mesh.generate.tensor, or lower max_num_seqs"
        )
    fsdp, tensor = train_mesh.shape["fsdp"], train_mesh.shape["tensor"]
    expert = train_mesh.shape.get("expert", 1)  # kept: fsdp takes the devices data has
    for name, x in plan.xla_gpu.items():  # a program XLA:GPU cannot compile cannot run
        if "error" in x and name == "reward" and cfg.reward_model.model.use_remove_padding:
            out["compile reward"] = (
                "XLA:GPU cannot compile the packed reward-model scoring: "
                "reward_model.model.use_remove_padding=False scores padded rows instead"
            )
        elif "error" in x:
            out[f"compile {name}"] = f"XLA:GPU cannot compile {name}: see the error above"
    # a stage is over when its count or XLA:GPU's compiled peak is
    peak = lambda s: max(s.peak, plan.xla_gpu.get(s.name, {}).get("peak", 0))
    over = sorted((s for s in plan.stages if peak(s) > plan.capacity), key=lambda s: -peak(s))
    for s in over:
        c, why = s.consumers, f"{size(peak(s) - plan.capacity)} short in {s.name}"
        add = lambda key, text: out.setdefault(key, f"{why}: {text}")
        states = sum(v for k, v in c.items() if "params" in k or "optimizer" in k)
        if fsdp * tensor * expert < devices and states > 0.25 * s.peak:
            most = devices // (tensor * expert)
            add(
                "mesh.train.fsdp",
                f"mesh.train.data=1 mesh.train.fsdp={most} (now fsdp {fsdp}) splits params and "
                f"optimizer states {most} ways (about {size(states * (1 - fsdp / most))} less)",
            )
        live = lambda *parts: sum(c.get(f"{s.name} {k}", 0) for k in parts)
        scratch = live("activations", "logits")
        if s.name.startswith("update") and scratch > 0.2 * s.peak:
            role, key = (
                (a.actor, "actor_rollout_ref.actor")
                if s.name == "update_actor"
                else (cfg.critic, "critic")
            )
            if not a.model.enable_gradient_checkpointing and live("activations") > 0.1 * s.peak:
                add(
                    "remat",
                    "actor_rollout_ref.model.enable_gradient_checkpointing=True (rematerialise "
                    f"each layer; activations {size(live('activations'))})",
                )
            if role.ppo_micro_batch_size_per_gpu > 1:
                micro = role.ppo_micro_batch_size_per_gpu
                add(
                    f"{key}.micro",
                    f"{key}.ppo_micro_batch_size_per_gpu={micro // 2} (activations and logits, "
                    f"{size(scratch)}, shrink about linearly with it)",
                )
        if s.name in ("old_log_prob", "ref", "values") and scratch > 0.2 * s.peak:
            micro = max(r.log_prob_micro_batch_size_per_gpu // 2, 1)
            add("log_prob", f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}")
        pool = c.get("KV pool", 0)
        if pool > 0.2 * s.peak and s.name != "gen":
            short = plan.worst.peak - plan.capacity
            fit = ""
            frac = r.gpu_memory_utilization * (pool - short) / pool
            if r.num_pages <= 0 and frac >= 0.05:  # below that the pool is all but gone
                fit = f" (rollout.gpu_memory_utilization={math.floor(frac * 100) / 100:.2f} fits)"
            add(
                "pool",
                f"the KV pool ({size(pool)}) stays allocated through every stage: lower "
                f"rollout.gpu_memory_utilization{fit} or set rollout.num_pages",
            )
        if s.name == "gen":
            for role, key in (
                ("actor optimizer state", "actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
                ("actor params", "actor_rollout_ref.actor.fsdp_config.param_offload"),
                ("ref params", "actor_rollout_ref.ref.fsdp_config.param_offload"),
            ):
                if c.get(role, 0) > 0.1 * s.peak:
                    add(key, f"{key}=True moves {size(c[role])} to host while generating")
        if s.name in ("gen", "reshard") and c.get("rollout weights", 0) > 0.2 * s.peak:
            add("tensor", "mesh.generate.tensor > 1 splits the rollout weights and KV pool")
    return list(out.values())


def memory_problems(cfg: ConfigDict, n_devices: int, actor_config) -> list[str]:
    """`trainer.check_memory`: the plan on this process's devices, as config problems (empty
    when it fits). The plan itself is logged."""
    target = platform_of(jax.devices()[:n_devices])
    # counted from shapes, without compiling every stage a second time (the run compiles them)
    plan = plan_memory(cfg, actor_config, n_devices, target=target, compile_stages=False)
    log.info("memory plan:\n%s", plan.report())
    if plan.fits:
        return []
    w = plan.worst
    return [
        f"trainer.check_memory: {w.name} needs {size(w.peak)} per device of "
        f"{size(plan.capacity)}; " + "; ".join(plan.advice or ("see the plan above",))
    ]
