"""LoRA on the critic: only the adapters and the new value head (`score`, peft's
`modules_to_save`) get gradients, optimizer state and a place in the checkpoint; the frozen
backbone is read again on resume; the config check names a bad critic target."""

from __future__ import annotations

import ast
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.decoder import SequenceClassifier
from hybridjax.models.lora import LoRAConfig, apply_lora, merge_trainable, split_trainable
from hybridjax.training import build
from hybridjax.training.optim import OptimConfig
from tests.models.test_lora import CONFIG, _batch
from tests.rl.test_trainer_end_to_end import _deterministic, _run
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

CRITIC_LORA = {
    "critic.model.lora_rank": 4,
    "critic.model.lora_alpha": 8.0,
    "critic.model.target_modules": "q_proj,v_proj",
    "critic.optim.lr": 1e-2,
    "trainer.test_freq": -1,
}


def _paths(state) -> set[str]:
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)}


def _trainable_is_adapters_and_head(state) -> None:
    paths = _paths(state)
    assert {"base.score"} <= paths
    others = paths - {"base.score", "base.score_bias"}
    assert others and all(p.startswith("adapters.") for p in others), sorted(others)
    assert all(p.split(".")[-2] in ("q_proj", "v_proj") for p in others)


def test_gradients_reach_only_critic_adapters_and_score_head():
    lora = LoRAConfig(4, 8.0, ("q_proj", "v_proj"), modules_to_save=("score",))
    critic = apply_lora(SequenceClassifier(CONFIG, nnx.Rngs(0)), lora, seed=1)
    ids, mask = _batch()
    graphdef, state = nnx.split(critic)
    trainable, frozen = split_trainable(state)
    _trainable_is_adapters_and_head(trainable)
    assert {"base.model.embed_tokens", "base.model.layers.0.self_attn.q_proj"} <= _paths(frozen)

    def loss(t):
        return jnp.square(nnx.merge(graphdef, merge_trainable(t, frozen))(ids, mask)).sum()

    grads = jax.grad(loss)(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    # B starts at 0, so dL/dA = 0 at the start (as peft); every B and the head move
    for path, g in nnx.to_flat_state(grads):
        if path[-1] != "lora_a":
            assert float(jnp.abs(g.get_value()).sum()) > 0, path
    opt = build.init_train_state(state, OptimConfig(1e-3, 0, 1)).opt_state
    sizes = sum(x.size for x in jax.tree.leaves(opt))
    assert 0 < sizes <= 3 * sum(x.size for x in jax.tree.leaves(trainable))


def test_config_check_rejects_bad_critic_target(tmp_path):
    from hybridjax.config.checks import ConfigError
    from hybridjax.rl.checks import validate
    from tests.rl.test_trainer_config import ACTOR, _load

    config = _load("tiny", tmp_path)
    config.critic.model.lora_rank = 8
    config.critic.model.target_modules = "q_proj,score"
    with pytest.raises(ConfigError, match=r"critic\.model\.target_modules: unknown \['score'\]"):
        validate(config, 8, ACTOR)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return gsm8k_subset(tmp_path_factory.mktemp("gsm8k"), train_rows=16, test_rows=8)


def _saved_critic(step_dir) -> tuple[set[str], set[str]]:
    """(params, optimizer-state) tensor paths of the critic in a checkpoint's tree metadata."""
    tree = json.loads((step_dir / "state" / "_METADATA").read_text())["tree_metadata"]
    keys = [ast.literal_eval(k) for k in tree]
    params = {".".join(k[2:-1]) for k in keys if k[:2] == ("critic", "params")}
    opt = {".".join(k[2:]) for k in keys if k[:2] == ("critic", "opt_state")}
    return params, opt


def _flat(state) -> dict:
    return {p: np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(state)}


@pytest.fixture(scope="module")
def whole(data, tmp_path_factory):
    """(trainer, run directory) of three PPO steps with the LoRA critic, saved at every step:
    the run both tests below read (its first step is what a one-step run would do)."""
    run_dir = tmp_path_factory.mktemp("whole")
    changes = CRITIC_LORA | {"trainer.total_training_steps": 3}
    return _run(tiny_config(data, run_dir, **changes)), run_dir


@pytest.mark.slow
def test_ppo_step_with_lora_critic_checkpoints_adapters_and_head(whole):
    trainer, run_dir = whole
    metrics = read_metrics(run_dir)[1]
    assert all(math.isfinite(v) for v in metrics.values())
    assert "critic/vf_loss" in metrics
    params, opt = _saved_critic(run_dir / "global_step_3")  # the trainer's own, last, step
    assert params == _paths(split_trainable(trainer.critic_state.params)[0])
    # no checkpointing: model.scan_layers "auto" keeps the per-layer loop, one adapter a layer
    assert {"base.score", "adapters.model.layers.0.self_attn.q_proj.lora_b"} <= params
    assert not any(p.startswith("base.model") for p in params | opt), "the backbone was saved"
    trainable = split_trainable(trainer.critic_state.params)[0]
    opt_size = sum(x.size for x in jax.tree.leaves(trainer.critic_state.opt_state))
    assert 0 < opt_size <= 3 * sum(x.size for x in jax.tree.leaves(trainable))


@pytest.mark.slow
def test_lora_critic_resume_is_exact(data, whole, tmp_path):
    changes = CRITIC_LORA | {"trainer.total_training_steps": 3}
    _run(tiny_config(data, tmp_path / "cut", **changes), stop_after=2)
    resumed = _run(tiny_config(data, tmp_path / "cut", **changes))
    assert resumed.global_step == 3
    a, b = (_flat(t.critic_state.params) for t in (whole[0], resumed))
    for path in a:  # adapters and head restored, backbone read again: all equal
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    assert _deterministic(read_metrics(tmp_path / "cut")[3]) == _deterministic(
        read_metrics(whole[1])[3]
    )
    params, _ = _saved_critic(tmp_path / "cut" / "global_step_3")
    assert params == _paths(split_trainable(resumed.critic_state.params)[0])
