"""The MoE router in the actor's update: HF's load-balancing loss per micro-batch, weighted by
response tokens, in the loss (`actor.moe_aux_loss_coeff`) and the `actor/moe_*` metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained
from hybridjax.rl import step
from hybridjax.sharding import ACTOR_TRAIN_RULES, MeshConfig, make_meshes, state_shardings
from hybridjax.sharding.mesh import pass_mesh
from hybridjax.sharding.roles import batch_sharding
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch
from tests.models.hf_testing import VOCAB, qwen3_moe_config, write_hf_model
from tests.rl.test_passes import MASK_BxR
from tests.rl.test_passes import _batch as dense_batch
from tests.rl.tiny_run import load_config_file


def _stage_config(micro: int, data_parallel: int = 1, **changes):
    """configs/tiny.py as one mini-batch of the 4 rows of MASK_BxR on `data_parallel` batch
    shards, padded micro-batches of `micro` rows."""
    c = load_config_file("tiny")
    c.data.train_batch_size = c.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro // data_parallel
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.response_length = c.data.max_response_length = 4
    c.actor_rollout_ref.model.use_remove_padding = False
    c.update_from_flattened_dict(changes)
    cfg = build.stage_config(c, total_steps=2, data_parallel=data_parallel)
    assert cfg.actor_update.packing is None
    return cfg


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(HF Qwen3-MoE, our graphdef, our train state) of one tiny random checkpoint."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf = write_hf_model(path, transformers.Qwen3MoeForCausalLM, qwen3_moe_config())
    graphdef, params = nnx.split(load_pretrained(path))
    return hf, graphdef, build.init_train_state(params, _stage_config(4).actor_optim)


def _batch(advantage: float):
    rng = np.random.default_rng(1)
    batch = make_batch(
        jnp.asarray(rng.integers(1, VOCAB, (4, 3))),
        jnp.ones((4, 3), jnp.int32),
        jnp.asarray(rng.integers(1, VOCAB, (4, 4)) * MASK_BxR.astype(int)),
        jnp.asarray(MASK_BxR),
    )
    return batch.replace(advantages=advantage * jnp.asarray(MASK_BxR))


def _hf_aux_loss(hf, batch, rows) -> float:
    """HF `load_balancing_loss_func` over the routed layers for the given rows."""
    take = lambda x: torch.tensor(np.asarray(x)[rows])
    with torch.no_grad():
        out = hf(
            input_ids=take(batch.input_ids),
            attention_mask=take(batch.attention_mask),
            position_ids=take(batch.position_ids),
            output_router_logits=True,
        )
    routed = tuple(g for g in out.router_logits if g is not None)
    return load_balancing_loss_func(routed, 8, 2, take(batch.attention_mask)).item()


def _update(moe, cfg, advantage=1.0):
    _, graphdef, state = moe
    batch = _batch(advantage)
    batch, _ = passes.compute_old_log_prob(graphdef, state.params, batch, cfg)
    _, metrics, nan = passes.update_actor(graphdef, state, batch, jax.random.key(0), cfg)
    assert int(nan) == 0
    return batch, {k: float(v) for k, v in metrics.items()}


def test_aux_loss_metric_is_hf_per_micro_batch_weighted_by_response_tokens(moe):
    """One micro-batch: HF's loss over the batch. Two (rows {0, 2} and {1, 3}, 6 and 4 of the
    10 response tokens): 0.6 · HF(rows 0, 2) + 0.4 · HF(rows 1, 3)."""
    hf = moe[0]
    batch, whole = _update(moe, _stage_config(4))
    ref = _hf_aux_loss(hf, batch, [0, 1, 2, 3])
    assert whole["actor/moe_aux_loss"] == pytest.approx(ref, abs=1e-5) and ref > 2.0
    _, split = _update(moe, _stage_config(2))
    ref = 0.6 * _hf_aux_loss(hf, batch, [0, 2]) + 0.4 * _hf_aux_loss(hf, batch, [1, 3])
    assert split["actor/moe_aux_loss"] == pytest.approx(ref, abs=1e-5)
    # 2 routed layers × 7 valid tokens × top-2 pairs per row; shares of one layer's pairs
    assert 1 / 8 < whole["actor/moe_expert_load_max"] <= 1.0
    assert 0.0 <= whole["actor/moe_expert_load_min"] < 1 / 8


def test_aux_loss_coefficient_scales_the_gradient(moe):
    """With zero advantages (on-policy, no entropy or KL term) the policy loss has no gradient:
    the whole gradient is coeff · ∇aux, so it is 0 at coeff 0 and doubles with the coeff."""
    norms = []
    for coeff in (0.0, 0.01, 0.02):
        cfg = _stage_config(2, **{"actor_rollout_ref.actor.moe_aux_loss_coeff": coeff})
        assert cfg.moe_aux_loss_coeff == coeff
        norms.append(_update(moe, cfg, advantage=0.0)[1]["actor/grad_norm"])
    assert norms[0] == 0.0 and norms[1] > 0.0
    assert norms[2] == pytest.approx(2 * norms[1], rel=1e-5)


def test_dense_models_report_no_router_metrics():
    config = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    cfg = _stage_config(2)
    state = build.init_train_state(params, cfg.actor_optim)
    batch, _ = passes.compute_old_log_prob(graphdef, params, dense_batch(), cfg)
    batch = batch.replace(advantages=jnp.asarray(MASK_BxR))
    _, metrics, _ = passes.update_actor(graphdef, state, batch, jax.random.key(0), cfg)
    assert "actor/pg_loss" in metrics
    assert not any(k.startswith("actor/moe") for k in metrics)


def test_router_replay_r2_records_and_replays_the_experts(moe):
    """R2: the old_log_prob pass records the experts HF's router picks for every valid token;
    the update replays them (ratio 1: `actor/ppo_kl` 0). Other experts in `routed_experts`
    move the update's log-probs, unless replay is disabled."""
    hf, graphdef, state = moe
    r2 = _stage_config(2, **{"actor_rollout_ref.actor.router_replay.mode": "R2"})
    assert r2.recompute_old_log_prob and r2.router_replay == "R2"
    batch, _ = passes.compute_old_log_prob(graphdef, state.params, _batch(1.0), r2)
    routed = np.asarray(batch.routed_experts)
    assert routed.shape == (4, 7, 2, 2) and routed.dtype == np.int32
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(np.asarray(batch.input_ids)),
            attention_mask=torch.tensor(np.asarray(batch.attention_mask)),
            position_ids=torch.tensor(np.asarray(batch.position_ids)),
            output_router_logits=True,
        )
    valid = np.asarray(batch.attention_mask).astype(bool)
    hf_logits = [g for g in out.router_logits if g is not None]
    for layer, logits in enumerate(hf_logits):
        hf_ids = torch.topk(logits, 2, dim=-1).indices.numpy().reshape(4, 7, 2)
        np.testing.assert_array_equal(
            np.sort(routed[:, :, layer], -1)[valid], np.sort(hf_ids, -1)[valid]
        )

    def ppo_kl(routed_experts, cfg):
        b = batch.replace(routed_experts=routed_experts)
        _, metrics, nan = passes.update_actor(graphdef, state, b, jax.random.key(0), cfg)
        assert int(nan) == 0
        return abs(float(metrics["actor/ppo_kl"]))

    other = (batch.routed_experts + 1) % 8
    assert ppo_kl(batch.routed_experts, r2) < 1e-6
    assert ppo_kl(other, r2) > 1e-3
    assert ppo_kl(other, _stage_config(2)) < 1e-6  # disabled: the batch's experts are unread


def test_expert_parallel_update_equals_one_device(moe):
    """mesh.train expert 2 × fsdp 2 × tensor 2 (batch rows over data × expert × fsdp = 4
    shards, experts over expert then fsdp): the step's jitted old_log_prob and update, entered
    with `pass_mesh`, equal the unpartitioned passes on one device within 1e-5, and the
    update's program runs the experts in `shard_map` (all-gather / reduce-scatter)."""
    _, graphdef, state = moe
    one, ep = _stage_config(4), _stage_config(4, data_parallel=4)
    meshes = make_meshes(MeshConfig(train=(1, 2, 2, 2), generate=(-1, 2)))
    mesh, key = meshes.train, jax.random.key(0)
    params = jax.device_put(state.params, state_shardings(state.params, mesh, ACTOR_TRAIN_RULES))
    gate = [v for p, v in nnx.to_flat_state(params) if p[-1] == "gate_proj"][0]
    assert gate.get_value().sharding.spec[0] == ("expert", "fsdp")
    sharded = build.init_sharded_train_state(params, ep.actor_optim)
    batch = jax.device_put(_batch(1.0), batch_sharding(mesh))

    ref_batch, _ = passes.compute_old_log_prob(graphdef, state.params, _batch(1.0), one)
    ref_state, ref_metrics, _ = passes.update_actor(graphdef, state, ref_batch, key, one)
    with pass_mesh(mesh):
        batch, _ = step._old_log_prob(graphdef, sharded.params, batch, ep)
        lowered = step._update_actor.lower(graphdef, sharded, batch, key, ep)
        new_state, metrics, nan = step._update_actor(graphdef, sharded, batch, key, ep)
    assert int(nan) == 0
    np.testing.assert_allclose(batch.old_log_probs, ref_batch.old_log_probs, atol=1e-5)
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/moe_aux_loss"):
        assert float(metrics[name]) == pytest.approx(float(ref_metrics[name]), abs=1e-5), name
    leaves = jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params)
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # the MoE layers' shard_map, and its reduce-scatter (GSPMD's FSDP program has none)
    assert 'manual_axes={"data", "expert", "fsdp", "tensor"}' in lowered.as_text()
    hlo = lowered.compile().as_text()
    assert "all-gather(" in hlo and "reduce-scatter(" in hlo
