"""Parity mode (`actor_rollout_ref.model.batch_invariant`) in a GRPO step without the
old_log_prob pass: the engine's log-probs are the update's π_old exactly, so the importance
ratio π_old / π_rollout is 1 on every token with no correction (`rollout_corr/*` metrics),
also with top-p / top-k sampling, the update scoring each token over its replayed support."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.config.checks import ConfigError
from hybridjax.models.decoder import CausalLM
from hybridjax.rl.checks import validate
from hybridjax.rl.pipeline import Stage
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
from hybridjax.training import build
from hybridjax.training.batch import make_batch
from tests.rl.test_trainer_on_policy import (
    GRPO,
    MODEL,
    _config,
    one_pool_run,
    run_device_stages,
)

PARITY = {
    "actor_rollout_ref.model.batch_invariant": True,
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.actor.recompute_old_log_prob": "false",
}
PROMPTS = [[5, 9, 2], [7, 1, 3]]


def _reward(batch, ctx):
    """Scores 1, 0, 0.3, 0.6 on each row's last valid token."""
    mask = np.asarray(batch.response_mask)
    scores = np.zeros(mask.shape, np.float32)
    scores[np.arange(4), mask.sum(-1).astype(int) - 1] = [1.0, 0.0, 0.3, 0.6]
    return batch.replace(token_level_scores=jnp.asarray(scores))


@pytest.mark.parametrize(
    "truncation",
    [{}] + [pytest.param(t, marks=pytest.mark.slow) for t in ({"top_p": 0.8}, {"top_k": 20})],
)
def test_without_the_old_log_prob_pass_the_ratio_to_the_rollout_is_exactly_one(truncation):
    rollout_keys = {f"actor_rollout_ref.rollout.{k}": v for k, v in truncation.items()}
    cfg = _config(**GRPO, **PARITY, **rollout_keys)
    sc = build.stage_config(cfg, total_steps=1, data_parallel=1)
    assert not sc.recompute_old_log_prob
    graphdef, params = nnx.split(CausalLM(dataclasses.replace(MODEL, batch_invariant=True),
                                          nnx.Rngs(0)))  # fmt: skip
    models = build.Models(
        graphdef, build.init_train_state(params, sc.actor_optim), None, None, None, None
    )
    rollout = RolloutConfig(page_size=4, max_num_seqs=4, prompt_length=3, response_length=4)
    engine = Engine(nnx.merge(graphdef, params), rollout)
    temperature = cfg.actor_rollout_ref.rollout.temperature
    sampling = SamplingParams(n=2, temperature=temperature, max_tokens=4, **truncation)
    out = generate(engine, PROMPTS, sampling)
    batch = make_batch(
        jnp.asarray(np.repeat(PROMPTS, 2, axis=0)), jnp.ones((4, 3), jnp.int32),
        jnp.asarray(out.responses), jnp.asarray(out.response_mask),
        jnp.asarray(out.rollout_log_probs), uid_B=jnp.asarray([0, 0, 1, 1]),
    )  # fmt: skip
    if truncation:  # the support each token was sampled from, replayed by the update
        assert sc.replay_sampling_mask
        batch = batch.replace(rollout_logit_threshold=jnp.asarray(out.rollout_logit_threshold))
    deps = types.SimpleNamespace(config=cfg, stage_cfg=sc, run=one_pool_run(sc))
    reward = Stage("reward", _reward, writes=("token_level_scores",))
    _, _, rec = run_device_stages(cfg, deps, models, batch, 1, reward)
    metrics = {k: float(v) for k, v in rec.metrics.items()}
    assert "old_log_prob" not in rec.timing
    assert metrics["rollout_corr/max_abs_log_prob_diff"] == 0.0
    assert metrics["rollout_corr/token_ratio_mean"] == 1.0
    assert metrics["rollout_corr/kl"] == 0.0 and metrics["training/rollout_probs_diff_max"] == 0.0


def test_parity_mode_refuses_packed_passes_and_a_rounded_generation_copy(tmp_path):
    cfg = _config(**GRPO, **PARITY)
    cfg.actor_rollout_ref.model.use_remove_padding = True
    cfg.actor_rollout_ref.rollout.dtype = "bfloat16"
    for key in ("train_files", "val_files"):
        (tmp_path / f"{key}.parquet").touch()
        cfg.data[key] = str(tmp_path / f"{key}.parquet")
    try:
        validate(cfg, 1)
    except ConfigError as err:
        message = str(err)
    else:
        raise AssertionError("accepted")
    assert "set actor_rollout_ref.model.use_remove_padding=False" in message
    assert "rollout.dtype='bfloat16' rounds them" in message
    cfg.actor_rollout_ref.model.use_remove_padding = False
    cfg.actor_rollout_ref.rollout.dtype = "auto"
    validate(cfg, 1)
    assert build.actor_model_config(cfg, types.SimpleNamespace(
        vocab_size=64, eos_token_ids=(), pad_token_id=0, bos_token_id=None,
    )).batch_invariant  # fmt: skip
