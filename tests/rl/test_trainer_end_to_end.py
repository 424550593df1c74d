"""Full RL steps on the tiny config, real GSM8K rows and the shipped tokenizer, 8 CPU devices."""

from __future__ import annotations

import dataclasses
import math
import signal

import jax
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict
from safetensors import safe_open

from hybridjax.checkpointing.export import export_actor
from hybridjax.models.decoder import CausalLM, SequenceClassifier
from hybridjax.models.hf_io import load_pretrained, save_pretrained
from hybridjax.rl import step as step_module
from hybridjax.rl.pipeline import Stage
from hybridjax.rl.trainer import RLTrainer
from hybridjax.sharding.offload import host_memory_kind
from hybridjax.training import build
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

pytestmark = pytest.mark.slow

PPO_KEYS = {
    *(f"timing_s/{s}" for s in ("step", "gen", "sleep", "reward", "old_log_prob", "values")),
    "timing_s/adv",
    "perf/sleep_bytes",
    *(f"timing_s/{s}" for s in ("update_critic", "update_actor", "reshard", "save_checkpoint")),
    "perf/total_num_tokens",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "perf/num_compiles",
    "perf/compile_time_s",
    *(f"critic/{k}/{s}" for k in ("score", "rewards", "advantages", "returns", "values")
      for s in ("mean", "max", "min")),
    "critic/vf_explained_var",
    *(f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
    *(f"prompt_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
    *(f"actor/{k}" for k in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy",
                             "kl_loss", "kl_coef", "grad_norm", "lr")),
    *(f"critic/{k}" for k in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr")),
    "training/global_step",
    "training/epoch",
    "training/rollout_probs_diff_mean",
    "rollout/num_compiles",
    "rollout/num_preemptions",
}  # fmt: skip
VAL_KEY = "val-core/openai/gsm8k/acc/mean@1"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"))


def _params(trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.actor_state.params))]


def _deterministic(metrics: dict) -> dict:
    """Metrics that depend only on the computation (not on wall time or the process's compile
    history, which a resumed process starts afresh)."""
    skip = ("timing_s/", "perf/", "rollout/num_compiles")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def _run(config, stop_after: int | None = None) -> RLTrainer:
    trainer = RLTrainer(config)
    if stop_after is not None:  # SIGTERM arrives during step `stop_after`
        step = trainer.train_step

        def interrupted(n):
            if n == stop_after:
                signal.raise_signal(signal.SIGTERM)
            return step(n)

        trainer.train_step = interrupted
    trainer.fit()
    trainer.close()
    return trainer


# KL in the reward with the adaptive controller, truncated importance sampling in the loss,
# DAPO's overlong penalty (responses longer than 16 − 4 tokens).
PPO_CHANGES = {
    "trainer.total_training_steps": 3,
    "algorithm.use_kl_in_reward": True,
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.rollout_is": True,
    "algorithm.rollout_is_threshold": 2.0,
    "reward_model.overlong_buffer.enable": True,
    "reward_model.overlong_buffer.len": 4,
}
PPO_EXTRA_KEYS = {
    "timing_s/ref",
    "training/rollout_probs_diff_max",
    "mismatch/rollout_is_mean",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "reward/overlong_penalty/mean",
    "reward/overlong_fraction",
}


def test_ppo_steps_metrics_and_exact_resume(data, tmp_path):
    """PPO with a critic, KL in the reward (adaptive), rollout IS and the overlong penalty:
    every metric present and finite; SIGTERM at step 2, resume, and step 3 gives bit-identical
    parameters, KL coefficient and metrics to the uninterrupted run."""
    changes = PPO_CHANGES
    whole = _run(tiny_config(data, tmp_path / "whole", **changes))
    metrics = read_metrics(tmp_path / "whole")
    for step in (1, 2, 3):
        missing = (PPO_KEYS | PPO_EXTRA_KEYS) - set(metrics[step])
        assert not missing, f"step {step} lacks {sorted(missing)}"
        bad = {k: v for k, v in metrics[step].items() if not math.isfinite(v)}
        assert not bad, f"step {step} has non-finite metrics {bad}"
    assert VAL_KEY in metrics[2] and 0.0 <= metrics[2][VAL_KEY] <= 1.0
    assert metrics[3]["training/global_step"] == 3
    assert metrics[1]["training/rollout_probs_diff_mean"] < 1e-5  # engine = trainer log-probs
    assert metrics[1]["mismatch/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    # step 1: the reference is the actor, KL 0, so β shrinks by (1 − 0.2 · 8 rows / 10000)
    assert metrics[1]["actor/kl_coef"] == pytest.approx(0.001, rel=1e-6)
    assert metrics[2]["actor/kl_coef"] == pytest.approx(0.001 * (1 - 0.2 * 8 / 10000), rel=1e-6)
    assert metrics[1]["actor/kl_coef"] == metrics[1]["actor/reward_kl_penalty_coeff"]
    assert -1.0 <= metrics[1]["reward/overlong_penalty/mean"] <= 0.0

    first = _run(tiny_config(data, tmp_path / "cut", **changes), stop_after=2)
    assert first.global_step == 2
    assert first.checkpointer.steps() == [1, 2]
    resumed = _run(tiny_config(data, tmp_path / "cut", **changes))
    assert resumed.global_step == 3
    assert float(resumed.kl_coef) == float(whole.kl_coef) < 0.001  # checkpointed controller
    for a, b in zip(_params(whole), _params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    cut = read_metrics(tmp_path / "cut")
    for step in (1, 2, 3):
        assert _deterministic(cut[step]) == _deterministic(metrics[step]), step

    at_step_3 = str(tmp_path / "cut" / "global_step_3")
    exporter = RLTrainer(tiny_config(data, tmp_path / "export", **changes, **{
        "trainer.resume_mode": at_step_3}))  # fmt: skip
    assert export_actor(exporter, str(tmp_path / "hf")) == 3
    exporter.close()
    reloaded = load_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys()  # tied embeddings: one tensor
    for a, b in zip(_params(whole), jax.tree.leaves(nnx.state(reloaded, nnx.Param)), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_grpo_steps_on_policy_ratio_and_kl_loss(data, tmp_path):
    """GRPO, n = 4, actor loaded from an HF directory, KL loss to the reference, a (random)
    reward model, optimizer state, reference and reward model offloaded (on the devices only in
    the stages that use them), one mini-batch per step: every
    update is exactly on-policy, so the `old_log_prob` pass is skipped (no timing entry) and
    π_old is the update's own log-probs, detached: ratio 1, ppo_kl and pg_clipfrac exactly 0
    at every step; every other metric (the rollout mismatch included) is present and finite."""
    config = tiny_config(
        data,
        tmp_path,
        **{
            "algorithm.adv_estimator": "grpo",
            "critic.enable": False,
            "actor_rollout_ref.rollout.n": 4,
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
            "trainer.total_training_steps": 2,
            "reward_model.enable": True,
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload": True,
            "actor_rollout_ref.ref.fsdp_config.param_offload": True,
            "reward_model.model.fsdp_config.param_offload": True,
            "reward_model.model.path": str(tmp_path / "rm"),
        },
    )
    # The actor comes from an HF checkpoint directory (weights + tokenizer), as a user's would.
    tokenizer = build.load_tokenizer(config)
    shape = build.actor_model_config(config, tokenizer)
    save_pretrained(CausalLM(shape, nnx.Rngs(3)), tmp_path / "actor")
    tokenizer.save(tmp_path / "actor")
    save_pretrained(
        SequenceClassifier(dataclasses.replace(shape, num_labels=1), nnx.Rngs(7)), tmp_path / "rm"
    )
    config.actor_rollout_ref.model.path = str(tmp_path / "actor")
    config.actor_rollout_ref.model.override_config = ConfigDict()
    config.data.tokenizer = ""
    trainer = _run(config)
    metrics = read_metrics(tmp_path)
    expected = {k for k in PPO_KEYS if not k.startswith(("critic/v", "critic/grad", "critic/lr"))}
    expected -= {"timing_s/values", "timing_s/update_critic", "timing_s/old_log_prob"}
    expected |= {"timing_s/ref", "timing_s/offload", "timing_s/onload", VAL_KEY}
    for step in (1, 2):
        assert not expected - set(metrics[step]) - ({VAL_KEY} if step == 1 else set())
        assert all(math.isfinite(v) for v in metrics[step].values())
        assert "timing_s/old_log_prob" not in metrics[step]
        assert metrics[step]["actor/ppo_kl"] == 0.0
        assert metrics[step]["actor/pg_clipfrac"] == 0.0
        assert metrics[step]["actor/pg_clipfrac_lower"] == 0.0
    assert metrics[1]["training/rollout_probs_diff_mean"] < 1e-5  # engine = trainer log-probs
    assert metrics[1]["actor/kl_loss"] == 0.0  # the reference equals the actor before step 1
    assert metrics[1]["critic/advantages/max"] > 0.0  # reward-model scores vary in groups
    assert 0.0 < metrics[1]["critic/score/max"] < 1.0  # a model score, not a rule's 0 / 1
    assert metrics[2]["actor/kl_loss"] > 0.0
    assert trainer.checkpointer.steps() == [1, 2]
    # what moved: to host before gen, the reference back for `ref` (and to host after it)
    ref_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.models.ref_params))
    assert metrics[2]["perf/onload_bytes"] >= 2 * ref_bytes  # ref, then `onload`
    assert metrics[2]["perf/offload_bytes"] == metrics[2]["perf/onload_bytes"]
    rm_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.models.reward_model[1])}
    assert rm_kinds == {host_memory_kind()}  # a device copy only while it scores


def test_remax_step_scores_a_greedy_baseline(data, tmp_path):
    """ReMax (n = 2, no critic): the gen stage also decodes each prompt greedily, the reward
    stage scores it, and advantage = the sample's reward − its prompt's greedy score."""
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) / 100.0\n"
    )
    config = tiny_config(data, tmp_path / "run", **{
        "algorithm.adv_estimator": "remax",
        "critic.enable": False,
        "actor_rollout_ref.rollout.n": 2,
        "custom_reward_function.path": str(reward_file),
        "trainer.total_training_steps": 1,
        "trainer.test_freq": -1,
    })  # fmt: skip
    prepared = []

    def keep(batch, ctx):
        prepared.append(batch)
        return batch

    pipeline = step_module.default_pipeline(config).insert_after("adv", Stage("keep", keep))
    trainer = RLTrainer(config, pipeline=pipeline)
    trainer.fit()
    trainer.close()
    batch = jax.device_get(prepared[0])
    baselines = np.asarray(batch.reward_baselines)
    np.testing.assert_array_equal(baselines[0::2], baselines[1::2])  # one per prompt
    assert baselines.max() > 0.0  # length-based scores of greedy responses
    scores = np.sum(np.asarray(batch.token_level_rewards) * batch.response_mask, axis=-1)
    expected = (scores - baselines)[:, None] * batch.response_mask
    np.testing.assert_allclose(batch.advantages, expected, rtol=1e-6, atol=1e-6)
    metrics = read_metrics(tmp_path / "run")[1]
    assert all(math.isfinite(v) for v in metrics.values())
    assert "actor/pg_loss" in metrics and "critic/advantages/max" in metrics
