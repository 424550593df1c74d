"""The stage programs of the memory plan: every device stage of the RL step lowered and
compiled for the run's training mesh from abstract inputs (XLA's outputs and donated bytes;
`hybridjax.memory.xla_gpu` on compile-only GPUs), with what it allocates while it runs counted
from shapes (`hybridjax.memory.counts`), beside the states it finds resident
(`hybridjax.memory.resident`). `gen` adds the rollout's decode scratch (analytic), `reshard`
the new rollout weights. Each stage becomes a `StagePlan` of `StageBook.plans`, in the step's
order.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from hybridjax.memory.counts import LoopStep, stage_bytes
from hybridjax.memory.report import StagePlan
from hybridjax.memory.resident import ResidentStates, abstract_batch, abstract_model, device_bytes
from hybridjax.memory.xla_gpu import (
    compile_on,
    memory_of,
    program_peak,
    relayout_scratch,
    resharded_leaves,
)
from hybridjax.models.logprobs import vocab_split
from hybridjax.sharding.layout import jit_keeping_state

# the planner's logger: a stage planned is the planner's event
log = logging.getLogger("hybridjax.memory.planner")


def decode_scratch(actor, r, tp: int, impl: str) -> int:
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


def stage_batches(cfg: ConfigDict, run: Any, actor_config: Any, response: int) -> tuple[Any, Any]:
    """(the batch the forward stages read, the one the updates read) as abstract RLBatches on
    the run's batch sharding: the update batch with every field the run's stages fill, and the
    replayed experts with router replay (R3: in the forward batch too)."""
    sc, roles, a = run.stage_cfg, run.roles, cfg.actor_rollout_ref
    rows = cfg.data.train_batch_size * a.rollout.n
    prompt = cfg.data.max_prompt_length
    sharding = run.batch_sharding
    forward_batch = abstract_batch(rows, prompt, response, sharding)
    fields = ["advantages", "returns", "token_level_scores", "token_level_rewards"]
    fields += ["old_log_probs"] * sc.recompute_old_log_prob + ["ref_log_prob"] * roles.reference
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
    return forward_batch, update_batch


class StageBook:
    """The plan's stages as they are planned (`plans`, in order), with XLA's CPU scratch
    (`xla_scratch`) and XLA:GPU's bytes (`xla_gpu`) of each compiled program.

    Args:
      cfg: the trainer config; run: its `RunConfig`.
      states: the resident states (`resident.resident_states`).
      idle: those of their bytes on the devices in a training stage that does not use them
        (`resident.on_devices`).
      compile_stages: compile each stage (else outputs from shapes); on_gpu: on compile-only
        GPUs (XLA:GPU's bytes into `xla_gpu`, a failed compile reported there).
      target: "gpu" (the blocked attention) or "cpu".
    """

    def __init__(
        self,
        cfg: ConfigDict,
        run: Any,
        states: ResidentStates,
        idle: dict[str, int],
        compile_stages: bool,
        on_gpu: bool,
        target: str,
    ):
        self.run, self.resident, self.idle = run, states.bytes, idle
        self.compile_stages, self.on_gpu = compile_stages, on_gpu
        self.fused = target == "gpu"  # the blocked attention (`models.attention.attention_backend`)
        self.rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
        self.prompt = cfg.data.max_prompt_length
        self.response = states.rollout.response_length
        self.plans: list[StagePlan] = []
        self.xla_scratch: dict[str, int] = {}
        self.xla_gpu: dict[str, dict[str, int]] = {}

    def stage(self, name, fn, args, batch, used, count) -> None:
        """Plans device stage `name`: `fn(*args)` compiled under the training mesh (as the step
        runs it: MoE experts in shard_map) for its outputs less its donated bytes, beside the
        idle states, the states it `used`, its `batch` and what it allocates (`count`)."""
        train, dp = self.run.meshes.train, self.run.data_parallel
        others = {k: v for k, v in self.idle.items() if k not in used}
        m: dict[str, int] = {}
        failed = None
        if self.compile_stages:
            compiled, failed = compile_on(train, fn, args, catch=self.on_gpu)
            if failed:  # XLA:GPU could not compile it: reported, counted from shapes
                self.xla_gpu[name] = {"error": failed}  # type: ignore[dict-item]
        if self.compile_stages and not failed:
            m = memory_of(compiled)
            if self.on_gpu:
                self.xla_gpu[name] = m | {"peak": sum(others.values()) + program_peak(m)}
                if name.startswith("update"):
                    leaves = resharded_leaves(compiled, args[1])
                    self.xla_gpu[name]["resharded_leaves"] = len(leaves)
            else:
                self.xla_scratch[name] = m["scratch"]
            outputs = m["outputs"] - m["aliased"]
        if not m:  # see `plan_memory`'s `compile_stages`
            updates = name.startswith("update")
            outputs = 0 if updates else device_bytes(batch) + self.rows * self.response * 4 // dp
            m = {"outputs": outputs}
        mine = {k: self.resident[k] for k in used} | {"batch": device_bytes(batch)}
        new = {f"{name} outputs": outputs}
        new |= {f"{name} {k}": v for k, v in count.items()}
        self.plans.append(StagePlan(name, others | mine | new))
        log.info("planned %s: XLA %s, counted %s", name, m, count)

    def count(self, kind, model_cfg, state, packing, micro_rows, head=True) -> dict[str, int]:
        """What a `kind` ("forward" | "update") stage allocates per device while it runs
        (`counts.stage_bytes`), one loop iteration of `micro_rows` rows."""
        sc, dp = self.run.stage_cfg, self.run.data_parallel
        step = LoopStep.of(packing, max(micro_rows // dp, 1), self.prompt, self.response)
        params = state.params if kind == "update" else state
        opt = device_bytes(state.opt_state) if kind == "update" else 0
        attention = "fused" if self.fused else "jnp"
        chunk = sc.head.chunk_size if sc.head.use_fused_kernels else 0
        split = vocab_split(sc.head.mesh, model_cfg.vocab_size, step.rows)
        vocab_axes = split[1] if split else ()
        mesh_shape = dict(self.run.meshes.train.shape)
        args = (kind, model_cfg, params, mesh_shape, step, attention, head, opt, chunk)
        return stage_bytes(*args, vocab_axes=vocab_axes)


def plan_gen(
    book: StageBook,
    cfg: ConfigDict,
    states: ResidentStates,
    on_device: dict[str, int],
    actor_config: Any,
    target: str,
) -> None:
    """Plans `gen`: the states on the devices while generating (`on_device`) and the decode
    loop's scratch; on compile-only GPUs also the engine's prefill, extend and decode programs
    (`memory.engine_programs`), the worst of them into `xla_gpu` with each one's peak and
    scratch."""
    from hybridjax.memory.engine_programs import engine_memory
    from hybridjax.models.decoder import CausalLM
    from hybridjax.rollout.decode_attention import select_decode_kernel
    from hybridjax.sharding import ACTOR_GENERATE_RULES

    r, gen = states.rollout, book.run.meshes.generate
    tp = gen.shape["tensor"]
    impl = select_decode_kernel(
        r.attention_impl, actor_config.sliding_window, target, actor_config.resolved_head_dim,
        r.page_size,
    )  # fmt: skip
    decode = decode_scratch(actor_config, r, tp, impl)
    book.plans.append(StagePlan("gen", on_device | {f"decode scratch ({impl})": decode}))
    if book.on_gpu:  # the engine's programs; their arguments hold the rollout weights and pool
        gen_def = abstract_model(CausalLM, actor_config, gen, ACTOR_GENERATE_RULES)[0]
        rollout = cfg.actor_rollout_ref.rollout
        programs = engine_memory(
            gen_def, states.gen_params, actor_config, rollout, gen, states.pages
        )
        rest = sum(v for k, v in on_device.items() if k not in ("rollout weights", "KV pool"))
        worst = max(programs, key=lambda k: program_peak(programs[k]))
        book.xla_gpu["gen"] = programs[worst] | {"peak": rest + program_peak(programs[worst])}
        book.xla_gpu["gen"] |= {f"{k} peak": program_peak(v) for k, v in programs.items()}
        book.xla_gpu["gen"] |= {f"{k} scratch": v["scratch"] for k, v in programs.items()}


def plan_reward(
    book: StageBook, cfg: ConfigDict, states: ResidentStates, forward_batch: Any, target: str
) -> None:
    """Plans `reward` when a reward model runs on the devices: a generative judge's pool (awake
    again) and decode scratch, or a classifier's `score_responses` on the training mesh."""
    from hybridjax.rewards.reward_model import score_responses
    from hybridjax.rollout.decode_attention import select_decode_kernel
    from hybridjax.training import build
    from hybridjax.training.packing import packing_configs

    run, r, rm_cfg = book.run, states.rollout, states.rm_cfg
    if states.judge:  # generation: its pool (awake again) and its decode loop's scratch
        jr, tp = states.judge_rollout, run.meshes.generate.shape["tensor"]
        j_impl = select_decode_kernel(
            r.attention_impl, rm_cfg.sliding_window, target, rm_cfg.resolved_head_dim, jr.page_size
        )
        scratch = {f"reward decode scratch ({j_impl})": decode_scratch(rm_cfg, jr, tp, j_impl)}
        pool = {"judge KV pool": book.resident["judge KV pool"]}
        book.plans.append(StagePlan("reward", book.idle | pool | scratch))
    elif run.roles.reward_model:  # `RewardStage.submit`: `score_responses` on the training mesh
        dp, rm = run.data_parallel, states.rm
        rm_packing = packing_configs(cfg, dp)["reward_model"]
        micro = build.forward_micro_batch(cfg.reward_model.micro_batch_size_per_gpu, book.rows, dp)
        prompt_mask = forward_batch.prompts  # B×P int32, as the prompt ids
        args = (states.rm_def, rm, forward_batch.prompts, prompt_mask, forward_batch.responses)
        args += (forward_batch.response_mask, micro, rm_packing)
        c = book.count("forward", rm_cfg, rm, rm_packing, micro, False)
        book.stage("reward", score_responses, args, forward_batch, ["reward model params"], c)


def plan_training(
    book: StageBook,
    states: ResidentStates,
    actor_config: Any,
    forward_batch: Any,
    update_batch: Any,
) -> None:
    """Plans the forward passes (`old_log_prob`, `ref`, `teacher`, `values`) and the updates
    (`update_critic`, `update_actor`) the run has, each compiled as the step jits it."""
    from hybridjax.training import passes

    run, s = book.run, states
    sc, roles, train = run.stage_cfg, run.roles, run.meshes.train
    key_dtype = jax.eval_shape(jax.random.key, 0).dtype
    rng = jax.ShapeDtypeStruct((), key_dtype, sharding=NamedSharding(train, PartitionSpec()))
    forward = lambda f: jax.jit(f, static_argnums=(0, 3))
    updater = lambda f: jit_keeping_state(f, static_argnums=(0, 4), state_argnum=1)  # as rl.step
    actor_def, actor_state = s.actor_def, s.actor_state
    log_micro = sc.log_prob_micro_batch_size
    if sc.recompute_old_log_prob:
        args = (actor_def, actor_state.params, forward_batch, sc)
        c = book.count(
            "forward", actor_config, actor_state.params, sc.old_log_prob_packing, log_micro
        )
        fn = forward(passes.compute_old_log_prob)
        book.stage("old_log_prob", fn, args, forward_batch, ["actor params"], c)
    if roles.reference:
        args = (actor_def, actor_state.params, forward_batch, sc)
        micro = sc.ref_log_prob_micro_batch_size or log_micro
        c = book.count("forward", actor_config, actor_state.params, sc.ref_packing, micro)
        fn = forward(passes.compute_ref_log_prob)
        book.stage("ref", fn, args, forward_batch, ["ref params"], c)
    if roles.teacher:  # the reference's forward, with the teacher's weights
        args = (s.teacher_def, s.teacher, forward_batch, sc)
        micro = sc.ref_log_prob_micro_batch_size or log_micro
        c = book.count("forward", s.teacher_cfg, s.teacher, sc.ref_packing, micro)
        fn = forward(passes.compute_teacher_log_prob)
        book.stage("teacher", fn, args, forward_batch, ["teacher params"], c)
    if s.critic_state is not None:
        critic_def, critic_state, critic_cfg = s.critic_def, s.critic_state, s.critic_cfg
        args = (critic_def, critic_state.params, forward_batch, sc)
        c = book.count(
            "forward", critic_cfg, critic_state.params, sc.values_packing, log_micro, False
        )
        fn = forward(passes.compute_values)
        book.stage("values", fn, args, forward_batch, ["critic params"], c)
        args = (critic_def, critic_state, update_batch, rng, sc)
        used = ["critic params", "critic optimizer state"]
        u = sc.critic_update
        c = book.count("update", critic_cfg, critic_state, u.packing, u.micro_batch_size, False)
        book.stage("update_critic", updater(passes.update_critic), args, update_batch, used, c)
    args = (actor_def, actor_state, update_batch, rng, sc)
    used = ["actor params", "actor optimizer state"]
    u = sc.actor_update
    c = book.count("update", actor_config, actor_state, u.packing, u.micro_batch_size)
    book.stage("update_actor", updater(passes.update_actor), args, update_batch, used, c)


def plan_reshard(book: StageBook, states: ResidentStates) -> None:
    """Plans `reshard`: the new rollout weights land beside the actor's, one leaf at a time
    (`update_weights`); on compile-only GPUs the worst leaf's XLA scratch into `xla_gpu`."""
    gen_params, resident = states.gen_params, book.resident
    largest_leaf = max(device_bytes(x) for x in jax.tree.leaves(gen_params))
    reshard = {"new rollout weights": resident["rollout weights"], "one leaf scratch": largest_leaf}
    actor = {"actor params": resident["actor params"]}
    book.plans.append(StagePlan("reshard", book.idle | actor | reshard))
    if book.on_gpu:  # one leaf moved at a time (`update_weights`): the worst leaf's XLA scratch
        targets = jax.tree.map(lambda x: x.sharding, gen_params)
        moved = relayout_scratch(states.actor_state.params, targets, states.gen_dtype)
        peak = sum((book.idle | actor).values()) + resident["rollout weights"] + moved
        book.xla_gpu["reshard"] = {"scratch": moved, "peak": peak}
