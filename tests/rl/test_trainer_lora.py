"""LoRA GRPO steps on the tiny config, 8 CPU devices: the reference is the base (adapters off),
the rollout decodes with the merged weights, only adapters train and are checkpointed, resume
is exact, and the export is a merged HF checkpoint plus a peft adapter."""

from __future__ import annotations

import ast
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from hybridjax.checkpointing.export import export_actor
from hybridjax.models.hf_io import load_pretrained
from hybridjax.models.lora import LoRAModel, split_trainable
from hybridjax.rl.trainer import RLTrainer
from tests.rl.test_trainer_end_to_end import _deterministic, _run
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

pytestmark = pytest.mark.slow

LORA = {
    "algorithm.adv_estimator": "grpo",
    "critic.enable": False,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.optim.lr": 1e-2,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.model.lora_rank": 4,
    "actor_rollout_ref.model.lora_alpha": 8.0,
    "actor_rollout_ref.model.target_modules": "q_proj,v_proj,o_proj,down_proj",
    "trainer.total_training_steps": 3,
    "trainer.test_freq": -1,
}


# The random model never answers GSM8K; a reward that varies within groups moves the adapters.
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(map(ord, solution_str)) % 7 / 7\n"
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gsm8k")
    (directory / "reward.py").write_text(REWARD)
    LORA["custom_reward_function.path"] = str(directory / "reward.py")
    return gsm8k_subset(directory, train_rows=32, test_rows=8)


def _flat(state) -> dict:
    return {p: np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(state)}


def test_lora_grpo_reference_is_base_resume_and_export(data, tmp_path):
    whole = _run(tiny_config(data, tmp_path / "whole", **LORA))
    metrics = read_metrics(tmp_path / "whole")
    for step in (1, 2, 3):
        assert all(math.isfinite(v) for v in metrics[step].values())
        assert "timing_s/ref" in metrics[step]
        # the engine decodes with the weights the re-layout merged: same log-probs as training
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-4
    assert metrics[1]["actor/kl_loss"] == 0.0  # B = 0: the actor starts as its reference
    assert metrics[3]["actor/kl_loss"] > 0.0  # the adapters moved; the reference did not

    # only adapters trained and hold optimizer state
    params = whole.actor_state.params
    trainable, frozen = split_trainable(params)
    fresh = nnx.split(nnx.merge(whole.actor_graphdef, params).base)[1]  # same base arrays
    before = _fresh_base(data, tmp_path)
    for path, value in _flat(fresh).items():
        np.testing.assert_array_equal(value, before[path])
    opt_size = sum(x.size for x in jax.tree.leaves(whole.actor_state.opt_state))
    assert 0 < opt_size < sum(x.size for x in jax.tree.leaves(frozen)) / 10

    # SIGTERM at step 2, resume from a checkpoint of adapters only: step 3 is bit-identical
    _run(tiny_config(data, tmp_path / "cut", **LORA), stop_after=2)
    resumed = _run(tiny_config(data, tmp_path / "cut", **LORA))
    assert resumed.global_step == 3
    a, b = _flat(trainable), _flat(split_trainable(resumed.actor_state.params)[0])
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path])
    cut = read_metrics(tmp_path / "cut")
    assert _deterministic(cut[3]) == _deterministic(metrics[3])
    # the checkpoint's tree (orbax stores arrays under hashed file names): adapters only
    tree = json.loads((tmp_path / "cut" / "global_step_3" / "state" / "_METADATA").read_text())
    keys = [ast.literal_eval(k) for k in tree["tree_metadata"]]
    saved = {".".join(map(str, k[2:])) for k in keys if k[:2] == ("actor", "params")}
    assert saved and all(".lora_" in path for path in saved), "the base was checkpointed"

    # export: merged HF weights + a peft adapter
    exporter = RLTrainer(tiny_config(data, tmp_path / "cut", **LORA))
    assert export_actor(exporter, str(tmp_path / "hf")) == 3
    exporter.close()
    assert (tmp_path / "hf" / "adapter" / "adapter_model.safetensors").is_file()
    merged = load_pretrained(tmp_path / "hf")
    model = nnx.merge(whole.actor_graphdef, params)
    assert isinstance(model, LoRAModel)
    ids = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
    mask = np.ones_like(ids)
    np.testing.assert_allclose(merged(ids, mask), model(ids, mask), atol=1e-5)


def _fresh_base(data, tmp_path) -> dict:
    """The base weights a fresh LoRA trainer starts from (same seed)."""
    trainer = RLTrainer(tiny_config(data, tmp_path / "fresh", **LORA))
    base = nnx.split(nnx.merge(trainer.actor_graphdef, trainer.actor_state.params).base)[1]
    trainer.close()
    return _flat(base)
