"""Scanned decoder layers (`ModelConfig.scan_layers`): the same logits and gradients as the
per-layer loop, with and without rematerialisation, and the same HF checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_testing import hf_logits, max_valid_diff, our_logits
from safetensors.numpy import load_file

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained, save_pretrained

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, family="qwen3", sliding_window=5,
)  # fmt: skip
REMATS = [
    dict(remat=False),
    dict(remat=True, remat_policy="full"),
    dict(remat=True, remat_policy="dots_with_no_batch_dims"),
]


def _batch():
    rng = np.random.default_rng(0)
    mask = np.ones((2, 9), np.int32)
    mask[1, :3] = 0  # left padding
    return jnp.asarray(rng.integers(1, 64, (2, 9))), jnp.asarray(mask)


def _log_likelihood(model) -> jax.Array:
    """Mean next-token log-likelihood of `_batch` under `model`."""
    ids, mask = _batch()
    lp = jax.nn.log_softmax(model(ids, mask)[:, :-1])
    picked = jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0]
    return (picked * mask[:, 1:]).sum() / mask[:, 1:].sum()


def _loss_and_grads(config: ModelConfig):
    """(`_log_likelihood`, its gradients by parameter path) of a fresh model (the same draws
    for every config: the flags change no parameter)."""
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    loss = lambda p: _log_likelihood(nnx.merge(graphdef, p))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, dict(nnx.to_flat_state(grads))


@pytest.mark.parametrize("remat", REMATS, ids=lambda r: r.get("remat_policy", "none"))
def test_scanned_loss_and_gradients_match_the_loop(remat):
    ref_value, ref_grads = _loss_and_grads(dataclasses.replace(TINY, **remat))
    value, grads = _loss_and_grads(dataclasses.replace(TINY, scan_layers=True, **remat))
    assert abs(float(value) - float(ref_value)) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for path, g in grads.items():
        np.testing.assert_allclose(g.get_value(), ref_grads[path].get_value(), atol=1e-5)
    layer_grad = grads[("model", "layers", 2, "mlp", "down_proj")].get_value()
    assert np.abs(layer_grad).max() > 1e-4  # the last layer is trained, not skipped


def test_scan_layers_refuses_mixture_of_experts_and_unknown_policies():
    moe = dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.scan_layers"):
        ModelConfig(**moe, scan_layers=True)
    with pytest.raises(ValueError, match="remat_policy"):
        ModelConfig(remat_policy="minimal")


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_hf_round_trip_with_scanned_layers(family, hf_checkpoints, padded_batch, tmp_path):
    path, hf_model = hf_checkpoints[family]
    loop = load_pretrained(path)
    scanned = load_pretrained(path, config_overrides={"scan_layers": True, "remat": True})
    assert scanned.config.scan_layers
    ours = our_logits(scanned, padded_batch)
    mask = padded_batch[1]
    assert max_valid_diff(ours, our_logits(loop, padded_batch), mask) < 1e-5
    assert max_valid_diff(ours, hf_logits(hf_model, *padded_batch), mask) < 1e-4
    save_pretrained(scanned, tmp_path)
    saved, original = (
        load_file(tmp_path / "model.safetensors"),
        load_file(path / "model.safetensors"),
    )
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(saved[name], tensor)


def test_lora_adapters_train_the_same_through_the_scan():
    """LoRA merges its adapters into per-layer weights before the forward, so a scanned base
    gives the loop's logits and adapter gradients."""
    from hybridjax.models.lora import LoRAConfig, apply_lora, split_trainable

    def grads(config):
        model = apply_lora(CausalLM(config, nnx.Rngs(0)), LoRAConfig(rank=2), seed=1)
        for adapter in model.adapters.values():  # B starts at 0: make the adapters count
            adapter.lora_b[...] = 0.02 * jnp.ones_like(adapter.lora_b[...])
        graphdef, state = nnx.split(model)
        trainable, frozen = split_trainable(state)
        loss = lambda t: _log_likelihood(nnx.merge(graphdef, nnx.merge_state(t, frozen)))

        return jax.jit(jax.value_and_grad(loss))(trainable)

    ref_value, ref_grads = grads(TINY)
    value, scanned_grads = grads(dataclasses.replace(TINY, scan_layers=True))
    assert abs(float(value) - float(ref_value)) < 1e-5
    for a, b in zip(jax.tree.leaves(scanned_grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)) > 1e-4
