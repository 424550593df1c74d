"""Qwen3, Llama 3.2 (tied) and Qwen3-MoE against `transformers`: logits, per-token log-probs,
the load-balancing loss, and round trips through our writer (float32, tolerance 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_testing import hf_logits, max_valid_diff, our_logits
from safetensors import safe_open
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hybridjax.models import ModelConfig
from hybridjax.models.hf_io import load_pretrained, save_pretrained
from hybridjax.models.moe import MoEMLP, with_router_stats

TOL = 1e-5
NEW_FAMILIES = ["qwen3", "llama3.2", "qwen3_moe"]


def _next_token_log_probs(logits_BxTxV, ids_BxT) -> np.ndarray:
    """log p(ids[t+1] | ids[:t+1]), B×(T-1)."""
    logp = jax.nn.log_softmax(jnp.asarray(logits_BxTxV[:, :-1]), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids_BxT[:, 1:, None]), -1)[..., 0])


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    return {f: load_pretrained(hf_checkpoints[f][0]) for f in NEW_FAMILIES}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_logits_and_log_probs_match_transformers(family, hf_checkpoints, loaded, padded_batch):
    ids, mask, _ = padded_batch
    ref = hf_logits(hf_checkpoints[family][1], *padded_batch)
    ours = our_logits(loaded[family], padded_batch)
    assert np.abs(ref).max() > 1.0
    assert max_valid_diff(ours, ref, mask) <= TOL
    pair_mask = mask[:, 1:] * mask[:, :-1]
    lp_ours, lp_ref = _next_token_log_probs(ours, ids), _next_token_log_probs(ref, ids)
    assert max_valid_diff(lp_ours, lp_ref, pair_mask) <= TOL


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_round_trip_through_our_writer(family, tmp_path, hf_checkpoints, loaded, padded_batch):
    """Our writer's checkpoint loads in transformers with the very same tensors, and back in
    hybridjax with the same config and logits."""
    _, hf_model = hf_checkpoints[family]
    save_pretrained(loaded[family], tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf_model)
    for name, p in hf_model.state_dict().items():
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    again = load_pretrained(tmp_path)
    assert again.config == loaded[family].config
    ref = hf_logits(hf_model, *padded_batch)
    assert max_valid_diff(our_logits(again, padded_batch), ref, padded_batch[1]) <= TOL


def test_what_the_families_exercise(loaded):
    q3, l32, moe = (loaded[f] for f in NEW_FAMILIES)
    assert q3.config.qk_norm and not q3.config.attention_bias and q3.config.tie_word_embeddings
    assert q3.config.resolved_head_dim * q3.config.num_attention_heads != q3.config.hidden_size
    assert not hasattr(q3, "lm_head") and not hasattr(l32, "lm_head")
    assert l32.config.tie_word_embeddings and l32.config.rope_scaling_dict["rope_type"] == "llama3"
    kinds = [type(layer.mlp).__name__ for layer in moe.model.layers]
    assert kinds == ["MoEMLP", "MLP", "MoEMLP"]
    assert moe.config.norm_topk_prob and moe.config.num_experts == 8


def test_num_params_counts_what_transformers_has(hf_checkpoints, loaded):
    for family in NEW_FAMILIES:
        hf_model = hf_checkpoints[family][1]
        assert loaded[family].config.num_params() == sum(p.numel() for p in hf_model.parameters())
    c = loaded["qwen3_moe"].config
    per_layer = 3 * c.hidden_size * c.moe_intermediate_size * (c.num_experts - 2)
    assert c.num_params() - c.num_params(active=True) == 2 * per_layer


def test_experts_are_saved_one_tensor_each(tmp_path, loaded):
    """As Qwen3-30B-A3B's checkpoints: `mlp.experts.{e}.*_proj.weight`, (out, in) each."""
    save_pretrained(loaded["qwen3_moe"], tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.2.mlp.experts.7.down_proj.weight")
    assert "model.layers.0.mlp.gate.weight" in names
    assert {f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(8)} <= names
    assert not any("layers.1.mlp.experts" in n for n in names)
    ours = loaded["qwen3_moe"].model.layers[2].mlp.experts.down_proj[...][7]
    np.testing.assert_array_equal(w, np.asarray(ours).T)


def test_routing_changes_logits(hf_checkpoints, padded_batch):
    """Dropping norm_topk_prob moves the logits far beyond tolerance (routing is live)."""
    path, hf_model = hf_checkpoints["qwen3_moe"]
    altered = load_pretrained(path, config_overrides={"norm_topk_prob": False})
    ref = hf_logits(hf_model, *padded_batch)
    assert max_valid_diff(our_logits(altered, padded_batch), ref, padded_batch[1]) > 1e-2


_forward_with_stats = nnx.jit(with_router_stats(lambda model, *batch: model(*batch)))


def test_aux_loss_and_experts_equal_transformers(hf_checkpoints, loaded, padded_batch):
    """`RouterStats.aux_loss` equals HF `load_balancing_loss_func` over the same padded batch,
    and every valid token picked the experts HF's router picked."""
    ids, mask, positions = padded_batch
    hf_model = hf_checkpoints["qwen3_moe"][1]
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            output_router_logits=True,
        )
    routed = [g for g in out.router_logits if g is not None]
    assert len(routed) == 2  # layers 0 and 2
    ref = load_balancing_loss_func(tuple(routed), 8, 2, torch.tensor(mask)).item()
    model = loaded["qwen3_moe"]
    _, stats = _forward_with_stats(model, *(jnp.asarray(x) for x in padded_batch))
    assert not any(m.record for m in nnx.iter_modules(model) if isinstance(m, MoEMLP))
    assert abs(float(stats.aux_loss()) - ref) <= 1e-6 and ref > 2.0  # 2 = top-k, uniform
    np.testing.assert_allclose(float(stats.load_fraction().sum()), 1.0, atol=1e-6)
    valid = mask.astype(bool)
    for layer, logits in enumerate(routed):
        hf_ids = torch.topk(logits, 2, dim=-1).indices.numpy().reshape(*mask.shape, 2)
        ours = np.asarray(stats.expert_ids[layer])
        np.testing.assert_array_equal(np.sort(ours[valid], -1), np.sort(hf_ids[valid], -1))


def test_qwen3_config_checks():
    hf = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_dict({**hf, "attention_bias": True})
    moe = {**hf, "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 4}
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_dict(moe)
    with pytest.raises(ValueError, match="exceeds"):
        ModelConfig.from_hf_dict({**moe, "num_experts": 2, "num_experts_per_tok": 3})
    config = ModelConfig.from_hf_dict({**moe, "num_experts": 4, "num_experts_per_tok": 2})
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"family": "gemma"}, "unknown family 'gemma'"),
        ({"num_experts": 4}, "needs family 'qwen3_moe'"),
        (
            {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5},
            "num_experts_per_tok",
        ),
        ({"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}, "moe_intermediate"),
    ],
)
def test_inconsistent_model_configs_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)
