"""The on-policy shortcut: with one optimizer step per RL step the `old_log_prob` pass is skipped
and π_old is the update's own log-probs, detached. Two steps of the default pipeline's device
stages on a tiny model, with the pass forced on and off, for GRPO and for PPO with a critic."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.config.checks import ConfigError
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.rl import step
from hybridjax.rl.checks import validate
from hybridjax.rl.pipeline import Record, Stage, StepContext
from hybridjax.sharding.mesh import TRAIN_AXES
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch
from hybridjax.training.update import UpdateConfig
from tests.rl.tiny_run import load_config_file

MODEL = ModelConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
)  # fmt: skip
# 4 responses of 4 tokens after 3-token prompts; valid lengths 4, 3, 2, 1.
MASK_BxR = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
SCORES_B = np.array([1.0, 0.0, 0.2, 0.7], np.float32)  # varies inside each pair (GRPO, n = 2)

GRPO = {"algorithm.adv_estimator": "grpo", "critic.enable": False, "actor_rollout_ref.rollout.n": 2}
PPO = {"algorithm.adv_estimator": "gae", "critic.enable": True, "actor_rollout_ref.rollout.n": 1}
CURRENT_LOG_PROBS = step._old_log_prob  # jitted; kept before a test replaces it


def one_pool_run(sc):
    """The `RunConfig` fields the device stages read, with every role on the actor's pool: one
    device's training mesh and `sc` for every role."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), TRAIN_AXES)
    return types.SimpleNamespace(
        pool_batch_shardings={},
        stage_config_of=lambda role: sc,
        meshes=types.SimpleNamespace(train=mesh),
        role_meshes={},
    )


def _config(**changes):
    """configs/tiny.py sized to one mini-batch of the 4 rows above (2 micro-batches)."""
    c = load_config_file("tiny")
    n = changes.get("actor_rollout_ref.rollout.n", 1)
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 4 // n
    c.critic.ppo_mini_batch_size = 4 // n
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    c.critic.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.response_length = c.data.max_response_length = 4
    c.actor_rollout_ref.actor.optim.lr = 1e-2  # big enough to move the ratio in step 2
    c.update_from_flattened_dict(changes)
    return c


def _batch(seed):
    rng = np.random.default_rng(seed)
    return make_batch(
        jnp.asarray(rng.integers(1, 60, (4, 3))),
        jnp.ones((4, 3), jnp.int32),
        jnp.asarray(rng.integers(1, 60, (4, 4)) * MASK_BxR.astype(int)),
        jnp.asarray(MASK_BxR),
        uid_B=jnp.asarray([0, 0, 1, 1]),
    )


def _fixed_reward(batch, ctx):
    """The reward stage with fixed scores on the last valid token."""
    scores = np.zeros((4, 4), np.float32)
    scores[np.arange(4), MASK_BxR.sum(-1).astype(int) - 1] = SCORES_B
    return batch.replace(token_level_scores=jnp.asarray(scores))


FIXED_REWARD = Stage("reward", _fixed_reward, writes=("token_level_scores",))


def run_device_stages(cfg, deps, models, batch, n: int, reward: Stage, last="update_actor"):
    """`reward` (a stage scoring the given `batch`), then the device stages of step `n` that
    `cfg`'s default pipeline has, in its order, up to `last`, called as `step.train_step`
    calls them; returns (batch, models, the step's `Record`)."""
    rec = Record()
    ctx = StepContext(n, deps, models, jnp.float32(0.0), metrics=rec.metrics, timing=rec.timing)
    batch, kl_coef = reward.fn(batch, ctx), jnp.float32(0.0)
    passes_ = {"old_log_prob": step.old_log_prob, "ref": step.ref_log_prob,
               "teacher": step.teacher_log_prob, "values": step.values}  # fmt: skip
    updates = {"update_critic": step.update_critic, "update_actor": step.update_actor}
    for name in step.default_pipeline(cfg).names:
        if name in passes_:
            batch = passes_[name](batch, models, deps, rec)
        elif name == "adv":
            batch, kl_coef = step.adv(batch, kl_coef, deps, rec)
        elif name in updates:
            models = updates[name](batch, models, deps, n, rec)
        if name == last:
            break
    return batch, models, rec


def _models(cfg, stage: passes.StageConfig) -> build.Models:
    graphdef, params = nnx.split(CausalLM(MODEL, nnx.Rngs(0)))
    critic_graphdef = critic_state = None
    if cfg.critic.enable:
        critic = SequenceClassifier(dataclasses.replace(MODEL, num_labels=1), nnx.Rngs(1))
        critic_graphdef, critic_params = nnx.split(critic)
        critic_state = build.init_train_state(critic_params, stage.critic_optim)
    return build.Models(
        graphdef, build.init_train_state(params, stage.actor_optim), None,
        critic_graphdef, critic_state, None,
    )  # fmt: skip


def _two_steps(cfg, monkeypatch):
    """Runs steps 1 and 2 (rollout log-probs: the trainer's at step start, 0.05 nats off);
    returns (final models, [(metrics, timing, expected rollout_probs_diff_mean) per step])."""
    sc = build.stage_config(cfg, total_steps=2, data_parallel=1)
    if not sc.recompute_old_log_prob:  # the stage must not run at all

        def never(*args):
            raise AssertionError("old_log_prob ran")

        monkeypatch.setattr(step, "_old_log_prob", never)
    models, out = _models(cfg, sc), []
    for n in (1, 2):
        batch = _batch(n)
        current, _ = CURRENT_LOG_PROBS(models.actor_graphdef, models.actor_state.params, batch, sc)
        batch = batch.replace(rollout_log_probs=(current.old_log_probs - 0.05) * MASK_BxR)
        p_old = np.exp(np.asarray(current.old_log_probs))[MASK_BxR > 0]
        diff_mean = float(np.mean(p_old * (1 - np.exp(-0.05))))  # |p − p·e^−0.05|
        deps = types.SimpleNamespace(config=cfg, stage_cfg=sc, run=one_pool_run(sc))
        _, models, rec = run_device_stages(cfg, deps, models, batch, n, FIXED_REWARD)
        metrics = {k: float(v) for k, v in rec.metrics.items()}
        out.append((metrics, rec.timing, diff_mean))
    return models, out


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("algorithm", [GRPO, PPO], ids=["grpo", "ppo_critic"])
def test_skipping_the_pass_gives_the_same_update(algorithm, monkeypatch):
    forced = _config(**algorithm, **{"actor_rollout_ref.actor.recompute_old_log_prob": "true"})
    auto = _config(**algorithm)
    assert build.recompute_old_log_prob(forced) and not build.recompute_old_log_prob(auto)
    with_pass, steps_with = _two_steps(forced, monkeypatch)
    without, steps_without = _two_steps(auto, monkeypatch)

    initial = _leaves(_models(auto, build.stage_config(auto, 2, 1)).actor_state)
    final = _leaves(with_pass.actor_state)
    moved = max(np.abs(a - b).max() for a, b in zip(final, initial, strict=True))
    assert moved > 1e-3  # the comparison below is not of two unchanged models
    for a, b in zip(_leaves(with_pass.actor_state), _leaves(without.actor_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if with_pass.critic_state is not None:
        critics = _leaves(with_pass.critic_state), _leaves(without.critic_state)
        for a, b in zip(*critics, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    for (m_with, t_with, _), (m_without, t_without, diff_mean) in zip(
        steps_with, steps_without, strict=True
    ):
        assert "old_log_prob" in t_with and "old_log_prob" not in t_without
        assert m_without["actor/ppo_kl"] == 0.0  # exactly: π_old is the detached π_θ
        assert m_without["actor/pg_clipfrac"] == m_without["actor/pg_clipfrac_lower"] == 0.0
        assert set(m_with) == set(m_without)  # every metric, rollout mismatch included
        diff = "training/rollout_probs_diff_"
        for key in (f"{diff}mean", f"{diff}max", f"{diff}std", "actor/pg_loss", "actor/entropy"):
            assert m_without[key] == pytest.approx(m_with[key], rel=1e-4, abs=1e-7), key
        assert m_without[f"{diff}mean"] == pytest.approx(diff_mean, rel=1e-4)


def test_auto_runs_the_pass_unless_the_update_is_on_policy():
    on_policy = _config(**GRPO)
    assert not build.off_policy_reasons(on_policy)
    off = {
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1,  # 2 mini-batches
        "algorithm.use_kl_in_reward": True,
        "algorithm.rollout_is_threshold": 2.0,
    }
    for key, value in off.items():
        cfg = _config(**GRPO, **{key: value})
        reasons = build.off_policy_reasons(cfg)
        assert len(reasons) == 1 and key.rsplit(".", 1)[1] in reasons[0]
        assert build.recompute_old_log_prob(cfg)
        cfg.actor_rollout_ref.actor.recompute_old_log_prob = "false"
        assert not build.recompute_old_log_prob(cfg)


def test_false_is_rejected_when_the_update_is_not_on_policy(tmp_path):
    cfg = _config(**GRPO, **{
        "actor_rollout_ref.actor.recompute_old_log_prob": "false",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 1,  # 2 mini-batches of 2 prompts
    })  # fmt: skip
    for key in ("train_files", "val_files"):
        (tmp_path / f"{key}.parquet").touch()
        cfg.data[key] = str(tmp_path / f"{key}.parquet")
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    message = str(err.value)
    assert "recompute_old_log_prob is 'false'" in message
    assert "ppo_mini_batch_size (1) differs from data.train_batch_size (2)" in message
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    validate(cfg, 1)  # one mini-batch: accepted
    cfg.actor_rollout_ref.actor.recompute_old_log_prob = "never"
    with pytest.raises(ConfigError, match="recompute_old_log_prob: one of"):
        validate(cfg, 1)


def test_update_without_the_pass_refuses_several_mini_batches():
    cfg = _config(**GRPO, **{"actor_rollout_ref.actor.recompute_old_log_prob": "false"})
    sc = build.stage_config(cfg, total_steps=2, data_parallel=1)
    graphdef, params = nnx.split(CausalLM(MODEL, nnx.Rngs(0)))
    state = build.init_train_state(params, sc.actor_optim)
    batch = _batch(0).replace(advantages=jnp.asarray(MASK_BxR))
    two_minis = dataclasses.replace(sc, actor_update=UpdateConfig(1, 2, 2))
    with pytest.raises(ValueError, match="not on-policy"):
        passes.update_actor(graphdef, state, batch, jax.random.key(0), two_minis)
