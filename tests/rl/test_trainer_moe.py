"""Two GRPO steps on a tiny random Qwen3-MoE (4 experts, top-2; layer 1 dense), LoRA off and on,
on 8 CPU devices: every metric finite, gradients non-zero, the rollout engine's log-probs equal
the trainer's, router metrics reported. The full run is expert-parallel (mesh.train expert 2 ×
fsdp 4, the default FSDP taking the rest: the MoE layers run in shard_map, the engine gets the
experts re-laid out); the LoRA run turns on the load-balancing loss and routing replay R2
(unpacked passes); the R3 run replays the experts the rollout engine recorded,
expert-parallel."""

from __future__ import annotations

import math

import pytest
from flax import nnx

from tests.rl.test_trainer_end_to_end import _run
from tests.rl.tiny_run import gsm8k_subset, read_metrics, tiny_config

pytestmark = pytest.mark.slow

QWEN3_MOE = dict(
    family="qwen3_moe",
    attention_bias=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=(1,),
)
GRPO = {
    "algorithm.adv_estimator": "grpo",
    "critic.enable": False,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.actor.optim.lr": 1e-2,
    "trainer.total_training_steps": 2,
    "trainer.test_freq": -1,
}
LORA = {
    "actor_rollout_ref.model.lora_rank": 4,
    "actor_rollout_ref.model.lora_alpha": 8.0,
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.actor.moe_aux_loss_coeff": 0.01,
    "actor_rollout_ref.actor.router_replay.mode": "R2",
    "actor_rollout_ref.model.use_remove_padding": False,
}
R3 = {
    "actor_rollout_ref.actor.router_replay.mode": "R3",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
    "actor_rollout_ref.model.use_remove_padding": False,
    "mesh.train.expert": 2,
}
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return sum(map(ord, solution_str)) % 7 / 7\n"
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gsm8k")
    (directory / "reward.py").write_text(REWARD)
    GRPO["custom_reward_function.path"] = str(directory / "reward.py")
    return gsm8k_subset(directory, train_rows=16, test_rows=8)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_grpo_steps_on_qwen3_moe(lora, data, tmp_path):
    config = tiny_config(data, tmp_path, **GRPO, **(LORA if lora else {"mesh.train.expert": 2}))
    model = config.actor_rollout_ref.model
    model.override_config.update(QWEN3_MOE)
    model.override_config.attention_bias = False
    trainer = _run(config)
    assert dict(trainer.run.meshes.train.shape)["expert"] == (1 if lora else 2)
    flat = nnx.to_flat_state(trainer.actor_state.params)
    gate = next(v.get_value() for p, v in flat if p[-2:] == ("experts", "gate_proj"))
    assert gate.addressable_shards[0].data.shape[0] == (4 if lora else 2)  # experts per device
    metrics = read_metrics(tmp_path)
    for step in (1, 2):
        assert all(math.isfinite(v) for v in metrics[step].values()), metrics[step]
        assert metrics[step]["actor/grad_norm"] > 0.0
        assert metrics[step]["actor/moe_aux_loss"] > 0.0
        assert 0.25 <= metrics[step]["actor/moe_expert_load_max"] <= 1.0
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-4  # engine = trainer log-probs
    actor = nnx.merge(trainer.actor_graphdef, trainer.actor_state.params)
    actor = actor.base if lora else actor
    assert [type(layer.mlp).__name__ for layer in actor.model.layers] == ["MoEMLP", "MLP"]


def test_two_grpo_steps_with_rollout_routing_replay(data, tmp_path):
    """R3: the engine records every token's experts, the update (and the old_log_prob pass,
    here off: on-policy) replays them; the trainer's log-probs equal the engine's and the
    on-policy update's ratio is 1 on its first micro-batch step."""
    config = tiny_config(data, tmp_path, **GRPO, **R3)
    config.actor_rollout_ref.model.override_config.update(QWEN3_MOE)
    trainer = _run(config)
    assert trainer.engine.record_routing
    metrics = read_metrics(tmp_path)
    for step in (1, 2):
        assert all(math.isfinite(v) for v in metrics[step].values()), metrics[step]
        assert metrics[step]["actor/grad_norm"] > 0.0
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-4
