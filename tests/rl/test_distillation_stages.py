"""The `teacher` stage and the distillation advantage in the step's device stages, on a tiny
model (the on-policy tests' batch and config): a teacher equal to the student gives zero
reverse KL and zero advantage; another teacher gives −(π_old − π_teacher) per token."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.decoder import CausalLM
from hybridjax.rl import step
from hybridjax.sharding.mesh import TRAIN_AXES
from hybridjax.training import build, passes
from tests.rl.test_trainer_on_policy import (
    FIXED_REWARD,
    GRPO,
    MODEL,
    MASK_BxR,
    _batch,
    _config,
    one_pool_run,
    run_device_stages,
)
from tests.rl.tiny_run import load_config_file

PURE = {"actor_rollout_ref.distillation.enabled": True}  # loss_mode reward, no task advantage
TOPK = {"actor_rollout_ref.distillation.loss_mode": "forward_kl_topk"}


@functools.cache
def _run(teacher_seed: int, topk: int = 0):
    """The stages up to `adv` (old_log_prob → teacher → adv) of pure distillation with a teacher
    of the actor's shape from `teacher_seed` (the actor's is 0); with `topk`, the
    `forward_kl_topk` loss. Returns (batch, metrics)."""
    cfg = _config(
        **GRPO, **PURE, **(TOPK | {"actor_rollout_ref.distillation.topk": topk} if topk else {})
    )
    sc = build.stage_config(cfg, total_steps=1, data_parallel=1, actor=MODEL)
    graphdef, params = nnx.split(CausalLM(MODEL, nnx.Rngs(0)))
    teacher = nnx.split(CausalLM(MODEL, nnx.Rngs(teacher_seed)))
    models = build.Models(
        graphdef, build.init_train_state(params, sc.actor_optim), None, None, None, None,
        teacher=teacher,
    )  # fmt: skip
    deps = types.SimpleNamespace(config=cfg, stage_cfg=sc, run=one_pool_run(sc))
    names = step.default_pipeline(cfg).names
    assert topk or names.index("teacher") == names.index("old_log_prob") + 1
    batch, _, rec = run_device_stages(cfg, deps, models, _batch(1), 1, FIXED_REWARD, "adv")
    return batch, {k: float(v) for k, v in rec.metrics.items()}


def test_teacher_equal_to_student_gives_zero_distillation_reward():
    batch, metrics = _run(teacher_seed=0)
    np.testing.assert_array_equal(batch.teacher_log_prob, batch.old_log_probs)
    assert np.all(np.asarray(batch.advantages) == 0.0)
    assert metrics["distill/reverse_kl"] == 0.0


def test_other_teacher_gives_minus_the_reverse_kl_per_token():
    batch, metrics = _run(teacher_seed=3)
    old, teacher = np.asarray(batch.old_log_probs), np.asarray(batch.teacher_log_prob)
    k1 = (old - teacher) * MASK_BxR
    assert np.abs(k1).max() > 1e-3  # the teacher differs
    np.testing.assert_allclose(batch.advantages, -k1, atol=1e-6)
    assert metrics["distill/reverse_kl"] == np.float32(k1.sum() / MASK_BxR.sum())
    # the teacher's log-probs are an independent forward of the teacher (padded, unpacked)
    model = CausalLM(MODEL, nnx.Rngs(3))
    logits = model(batch.input_ids, batch.attention_mask, batch.position_ids)
    log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, 3 - 1 : -1]
    want = np.take_along_axis(log_softmax, np.asarray(batch.responses)[..., None], -1)[..., 0]
    np.testing.assert_allclose(teacher, want * MASK_BxR, atol=1e-5)


def test_mixing_keeps_the_task_advantage():
    batch, _ = _run(teacher_seed=3)
    sc = build.stage_config(_config(**GRPO, **PURE), total_steps=1, data_parallel=1)
    mixed = dataclasses.replace(sc.distillation, use_policy_loss=True, distillation_loss_coef=0.5)
    with_task, _, _ = passes.compute_advantage(
        batch, jnp.float32(0), dataclasses.replace(sc, distillation=mixed)
    )
    task, _, _ = passes.compute_advantage(  # GRPO's advantages, no distillation
        batch, jnp.float32(0), dataclasses.replace(sc, distillation=build.DistillationConfig())
    )
    k1 = (np.asarray(batch.old_log_probs) - np.asarray(batch.teacher_log_prob)) * MASK_BxR
    assert np.abs(np.asarray(task.advantages)).max() > 0.1
    np.testing.assert_allclose(
        with_task.advantages, np.asarray(task.advantages) - 0.5 * k1, atol=1e-6
    )


def test_stage_config_and_pipeline_follow_the_config():
    cfg = _config(**GRPO, **PURE)
    assert build.recompute_old_log_prob(cfg)  # the adv stage reads π_old
    assert "teacher" in step.default_pipeline(cfg).names
    assert "teacher" not in step.default_pipeline(_config(**GRPO)).names
    loss = dataclasses.replace(build.stage_config(cfg, 1, 1).distillation, loss_mode="k3")
    assert loss.as_loss and not loss.as_reward


def test_teacher_from_a_checkpoint_and_its_vocabulary_check():
    cfg = load_config_file("quickstart_distill")  # teacher: the quick start's SFT checkpoint
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), TRAIN_AXES)
    student = build.actor_model_config(cfg, build.load_tokenizer(cfg))
    graphdef, params = build.build_teacher(cfg, student, mesh)
    teacher = nnx.merge(graphdef, params)
    assert teacher.config.num_hidden_layers == 4 and teacher.config.hidden_size == 256
    assert student.num_hidden_layers == 2  # the student is the smaller model
    with pytest.raises(ValueError, match="distillation.teacher_model: vocab_size 1000 < .* 2000"):
        build.build_teacher(cfg, dataclasses.replace(student, vocab_size=2000), mesh)


def test_teacher_offload_key_moves_the_teacher_alone():
    """`distillation.teacher_model.fsdp_config.param_offload` sends the teacher's weights to host
    memory during generation and back; `ref.fsdp_config.param_offload` leaves them in place."""
    from hybridjax.sharding import load_to_device, offload_to_host
    from hybridjax.training.offload import move_idle_states, offload_configs

    cfg = _config(**GRPO, **PURE)
    sc = build.stage_config(cfg, total_steps=1, data_parallel=1)
    graphdef, params = nnx.split(CausalLM(MODEL, nnx.Rngs(0)))
    models = build.Models(
        graphdef, build.init_train_state(params, sc.actor_optim), None, None, None, None,
        teacher=nnx.split(CausalLM(MODEL, nnx.Rngs(3))),
    )  # fmt: skip
    kinds = lambda m: {x.sharding.memory_kind for x in jax.tree.leaves(m.teacher[1])}
    cfg.actor_rollout_ref.ref.fsdp_config.param_offload = True
    assert kinds(move_idle_states(models, offload_configs(cfg), offload_to_host)) == {"device"}
    cfg.actor_rollout_ref.distillation.teacher_model.fsdp_config.param_offload = True
    away = move_idle_states(models, offload_configs(cfg), offload_to_host)
    assert kinds(away) == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(away.actor_state.params)} == {"device"}
    back = move_idle_states(away, offload_configs(cfg), load_to_device)
    assert kinds(back) == {"device"}
    before, after = jax.tree.leaves(models.teacher[1]), jax.tree.leaves(back.teacher[1])
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def _full_log_softmax(seed: int, batch, temperature: float) -> np.ndarray:
    """B×R×V log π of the tiny model from `seed` at each response position: an independent,
    padded, unpacked forward with full logits."""
    model = CausalLM(MODEL, nnx.Rngs(seed))
    logits = model(batch.input_ids, batch.attention_mask, batch.position_ids) / temperature
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, 3 - 1 : -1]


def test_top_k_teacher_pass_and_loss_with_k_equal_v_give_the_exact_forward_kl():
    """`forward_kl_topk` with k = V = 64 (packed teacher pass): the stored top-k are the
    teacher's whole sorted distribution, and the update's `actor/distillation_loss` is the
    exact token-mean KL(π_teacher ‖ π_θ) of the full-vocabulary distributions."""
    v = MODEL.vocab_size
    batch, _ = _run(teacher_seed=3, topk=v)
    cfg = _config(**GRPO, **PURE, **TOPK, **{"actor_rollout_ref.distillation.topk": v})
    sc = build.stage_config(cfg, total_steps=1, data_parallel=1, actor=MODEL)
    assert sc.ref_packing is not None  # the packed, shared-prompt forward
    teacher = _full_log_softmax(3, batch, sc.temperature)
    top, ids = np.asarray(batch.teacher_topk_log_probs), np.asarray(batch.teacher_topk_ids)
    assert top.shape == ids.shape == (4, 4, v) and ids.dtype == np.int32
    want = -np.sort(-teacher, axis=-1) * MASK_BxR[..., None]
    np.testing.assert_allclose(top, want, atol=1e-5)
    picked = np.take_along_axis(teacher, ids, -1) * MASK_BxR[..., None]
    np.testing.assert_allclose(picked, top, atol=1e-5)  # the ids name those log-probs
    np.testing.assert_array_equal(np.asarray(batch.advantages), 0)  # pure distillation
    graphdef, params = nnx.split(CausalLM(MODEL, nnx.Rngs(0)))
    state = build.init_train_state(params, sc.actor_optim)
    _, metrics, _ = passes.update_actor(graphdef, state, batch, jax.random.key(0), sc)
    student = _full_log_softmax(0, batch, sc.temperature)
    kl = np.sum(np.exp(teacher) * (teacher - student), -1)
    want_loss = (kl * MASK_BxR).sum() / MASK_BxR.sum()  # actor.loss_agg_mode token-mean
    assert want_loss > 1e-3  # two random models, near uniform: they differ a little
    np.testing.assert_allclose(
        float(metrics["actor/distillation_loss"]), want_loss, rtol=1e-5, atol=1e-7
    )


def test_top_k_key_and_loss_mode_go_together():
    with pytest.raises(ValueError, match="distillation.topk must be >= 1 exactly when"):
        build.stage_config(_config(**GRPO, **PURE, **TOPK), 1, 1)
    topk = {"actor_rollout_ref.distillation.topk": 4}
    with pytest.raises(ValueError, match="distillation.topk must be >= 1 exactly when"):
        build.stage_config(_config(**GRPO, **PURE, **topk), 1, 1)
