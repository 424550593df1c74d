"""The trainer with scanned decoder layers (`actor_rollout_ref.model.scan_layers`): the actor
update and whole RL steps equal the per-layer loop's."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM, stack_layer_state
from hybridjax.rl.trainer import RLTrainer
from hybridjax.training import build, passes
from tests.rl.test_passes import _batch, _stage_config
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

SHAPE = ModelConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
)  # fmt: skip


def _update(config: ModelConfig):
    """(metrics, new parameters, in the stacked form) of one PPO update of a fresh actor of
    shape `config`."""
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    cfg = _stage_config()
    state = build.init_train_state(params, cfg.actor_optim)
    batch, _ = passes.compute_old_log_prob(graphdef, params, _batch(), cfg)
    batch = batch.replace(advantages=batch.response_mask * np.array([[1.0], [-0.5], [2], [-1]]))
    state, metrics, nan = passes.update_actor(graphdef, state, batch, jax.random.key(0), cfg)
    assert int(nan) == 0
    params = state.params if config.scan_layers else stack_layer_state(state.params)
    return metrics, jax.tree.leaves(params)


@pytest.mark.parametrize("policy", [None, "dots_with_no_batch_dims"])
def test_scanned_actor_update_matches_the_loop(policy):
    remat = {} if policy is None else {"remat": True, "remat_policy": policy}
    ref_metrics, ref_params = _update(dataclasses.replace(SHAPE, **remat))
    metrics, params = _update(dataclasses.replace(SHAPE, scan_layers=True, **remat))
    assert metrics.keys() == ref_metrics.keys()
    for key, value in metrics.items():
        np.testing.assert_allclose(value, ref_metrics[key], atol=1e-5, err_msg=key)
    assert float(ref_metrics["actor/grad_norm"]) > 0
    for a, b in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_ppo_steps_with_scanned_layers_match_the_loop(tmp_path):
    """Two PPO steps (actor and critic scanned, checkpointed layers, `dots_with_no_batch_dims`)
    log the per-layer loop's metrics; the rollout engine decodes from the same weights."""
    data = gsm8k_subset(tmp_path / "data")
    changes = {
        "trainer.total_training_steps": 2,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "actor_rollout_ref.model.remat_policy": "dots_with_no_batch_dims",
    }
    runs = {}
    for scan in (False, True):
        run_dir = tmp_path / f"scan_{scan}"
        value = "auto" if scan else "false"  # auto: on for this dense, checkpointed model
        config = tiny_config(
            data, run_dir, **changes, **{"actor_rollout_ref.model.scan_layers": value}
        )
        trainer = RLTrainer(config)
        assert trainer.actor_config.scan_layers is scan
        trainer.fit()
        trainer.close()
        runs[scan] = read_metrics(run_dir)
    skip = ("timing_s/", "perf/", "rollout/num_compiles")
    for step in (1, 2):
        ref = {k: v for k, v in runs[False][step].items() if not k.startswith(skip)}
        got = {k: v for k, v in runs[True][step].items() if not k.startswith(skip)}
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), key
    assert runs[True][1]["actor/grad_norm"] > 0
