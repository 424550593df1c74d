"""Sampling-mask replay end to end: one GRPO step of the quick start sampling with top-p 0.8
and with top-k 20. With the replayed support the trainer's π_old equals the rollout's
log-probs (IS ratio mean within 1e-3 of 1, float32); scoring over the full vocabulary the
ratio is each token's kept probability mass instead."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from hybridjax.rl import step as step_module
from hybridjax.rl.pipeline import Stage
from hybridjax.rl.trainer import RLTrainer
from tests.rl.tiny_run import load_config_file, read_metrics

RATIO = "rollout_corr/token_ratio_mean"


def _quickstart(run_dir, **changes):
    """The quick start cut to one step of 4 prompts × 8 samples, no validation."""
    c = load_config_file("quickstart")
    c.data.train_batch_size = 4
    a = c.actor_rollout_ref
    a.actor.ppo_mini_batch_size = 4
    a.actor.ppo_micro_batch_size_per_gpu = 4  # × 8 test devices
    a.rollout.log_prob_micro_batch_size_per_gpu = 4
    t = c.trainer
    t.total_training_steps, t.test_freq, t.val_before_train = 1, -1, False
    t.default_local_dir, t.logger, t.progress_bar = str(run_dir), ("jsonl",), False
    c.update_from_flattened_dict(changes)
    return c


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"top_p": 0.8}, {"top_k": 20}], ids=["top_p", "top_k"])
def test_replayed_support_makes_the_rollout_ratio_one(tmp_path, sampling):
    changes = {f"actor_rollout_ref.rollout.{k}": v for k, v in sampling.items()}
    config = _quickstart(tmp_path, **changes)
    seen = {}

    def both_semantics(batch, ctx):
        """π_old over the replayed support and over the full vocabulary, same weights."""
        m = ctx.models
        for replay in (True, False):
            sc = dataclasses.replace(ctx.stage_config, replay_sampling_mask=replay)
            out, metrics = step_module._old_log_prob(
                m.actor_graphdef, m.actor_state.params, batch, sc
            )
            seen[replay] = jax.device_get((out, metrics))
        return batch

    pipeline = step_module.default_pipeline(config).insert_after(
        "gen", Stage("both", both_semantics)
    )
    trainer = RLTrainer(config, pipeline=pipeline)
    assert trainer.stage_config_of("actor").replay_sampling_mask  # "auto": replay
    trainer.fit()
    trainer.close()

    logged = read_metrics(tmp_path)[1]
    assert abs(logged[RATIO] - 1.0) < 1e-3, logged[RATIO]  # the update's own π_old
    (replayed, m_replay), (full, m_full) = seen[True], seen[False]
    assert abs(float(m_replay[RATIO]) - 1.0) < 1e-3
    mask = np.asarray(replayed.response_mask) > 0
    threshold = np.asarray(replayed.rollout_logit_threshold)
    assert np.isfinite(threshold[mask]).mean() > 0.5  # most tokens were truncated
    # full vocabulary: ρ_t = π_full / π_truncated = the kept mass M_t = exp(full − replayed)
    kept = np.exp(np.asarray(full.old_log_probs) - np.asarray(replayed.old_log_probs))[mask]
    print(
        f"{sampling}: kept mass {kept.mean():.5f}, ratio full {float(m_full[RATIO]):.5f}, "
        f"replayed {float(m_replay[RATIO]):.6f}"
    )
    assert np.all(kept <= 1 + 1e-5) and 1 - kept.mean() > 1e-3  # the truncation shows
    np.testing.assert_allclose(float(m_full[RATIO]), kept.mean(), atol=2e-4)
