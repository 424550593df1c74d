"""Scanned decoder layers (`ModelConfig.scan_layers`): parameters stored stacked with the
per-layer model's values, and the same logits, gradients, decoding and HF checkpoints as the
per-layer loop, with and without rematerialisation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_testing import hf_logits, max_valid_diff, our_logits
from safetensors.numpy import load_file

from hybridjax.models.attention import DenseKVCache
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import (
    CausalLM,
    DecoderLayer,
    stack_layer_state,
    unstack_layer_state,
)
from hybridjax.models.hf_io import load_pretrained, save_pretrained
from hybridjax.sharding.rules import ROLE_RULES

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, family="qwen3", sliding_window=5,
)  # fmt: skip
SCANNED = dataclasses.replace(TINY, scan_layers=True)
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
    """(`_log_likelihood`, its gradients as a stacked state) of a fresh model (the same draws
    for every config)."""
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    loss = lambda p: _log_likelihood(nnx.merge(graphdef, p))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    if not config.scan_layers:
        grads = stack_layer_state(grads)
    return value, dict(nnx.to_flat_state(grads))


def _flat(model) -> dict:
    return dict(nnx.to_flat_state(nnx.state(model)))


def test_scanned_model_stores_the_per_layer_models_parameters_stacked():
    loop, scanned = CausalLM(TINY, nnx.Rngs(0)), CausalLM(SCANNED, nnx.Rngs(0))
    assert isinstance(scanned.model.layers, DecoderLayer)
    q = scanned.model.layers.self_attn.q_proj
    assert q.get_value().shape == (3, 32, 4, 8)
    assert q.get_metadata()["axes"] == ("layers", "embed", "heads", "head_dim")
    stacked, ours = _flat(stack_layer_state(nnx.state(loop))), _flat(scanned)
    assert stacked.keys() == ours.keys()
    for path, var in ours.items():
        np.testing.assert_array_equal(var.get_value(), stacked[path].get_value())
        assert var.get_metadata() == stacked[path].get_metadata(), path
    back, per_layer = dict(nnx.to_flat_state(unstack_layer_state(nnx.state(scanned)))), _flat(loop)
    assert back.keys() == per_layer.keys()
    for path, var in per_layer.items():
        np.testing.assert_array_equal(var.get_value(), back[path].get_value())
        assert var.get_metadata() == back[path].get_metadata(), path
    for _, rules in ROLE_RULES.values():
        assert dict(rules)["layers"] is None


@pytest.mark.parametrize("remat", REMATS, ids=lambda r: r.get("remat_policy", "none"))
def test_scanned_loss_and_gradients_match_the_loop(remat):
    ref_value, ref_grads = _loss_and_grads(dataclasses.replace(TINY, **remat))
    value, grads = _loss_and_grads(dataclasses.replace(SCANNED, **remat))
    assert abs(float(value) - float(ref_value)) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for path, g in grads.items():
        np.testing.assert_allclose(g.get_value(), ref_grads[path].get_value(), atol=1e-5)
    layer_grad = grads[("model", "layers", "mlp", "down_proj")].get_value()
    assert np.abs(layer_grad[2]).max() > 1e-4  # the last layer is trained, not skipped


def _decode(model, cache) -> tuple[np.ndarray, DenseKVCache]:
    """Logits of `_batch` decoded as a 4-token prefill then one token per call."""
    ids, mask = _batch()
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    decode = nnx.jit(lambda m, *args: m.decode(*args))
    pieces = []
    for lo, hi in [(0, 4), *((t, t + 1) for t in range(4, 9))]:
        logits, cache = decode(model, ids[:, lo:hi], positions[:, lo:hi], mask[:, lo:hi], cache)
        pieces.append(np.asarray(logits))
    return np.concatenate(pieces, axis=1), cache


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_cache", "tuple_cache"])
def test_scanned_decode_equals_the_full_forward(stacked):
    """A scanned model decodes as one scan on a stacked cache (the layer a traced index), and
    layer by layer on a per-layer one; both equal the full forward (window 5 < 9 tokens)."""
    model = CausalLM(SCANNED, nnx.Rngs(0))
    ids, mask = _batch()
    full = np.asarray(model(ids, mask))
    cache = DenseKVCache.create(SCANNED, 2, 9, stacked=stacked)
    assert isinstance(cache.k, tuple) is not stacked
    incremental, cache = _decode(model, cache)
    assert max_valid_diff(incremental, full, mask) < 1e-5
    loop, _ = _decode(CausalLM(TINY, nnx.Rngs(0)), DenseKVCache.create(TINY, 2, 9))
    assert max_valid_diff(incremental, loop, mask) < 1e-5
    if stacked:
        assert cache.k.shape == (3, 2, 9, 2, 8)
        assert np.abs(np.asarray(cache.k[2])).max() > 0  # the last layer wrote its keys


def test_scan_layers_auto_is_on_for_dense_models_and_off_for_mixture_of_experts():
    moe = dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert ModelConfig(scan_layers="auto", remat=True).scan_layers is True
    assert ModelConfig(scan_layers="auto").scan_layers is False  # no remat: the loop
    assert ModelConfig(**moe, scan_layers="auto", remat=True).scan_layers is False
    with pytest.raises(ValueError, match="actor_rollout_ref.model.scan_layers"):
        ModelConfig(**moe, scan_layers=True)
    with pytest.raises(ValueError, match="scan_layers must be"):
        ModelConfig(scan_layers="yes")
    with pytest.raises(ValueError, match="remat_policy"):
        ModelConfig(remat_policy="minimal")


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_hf_round_trip_with_scanned_layers(family, hf_checkpoints, padded_batch, tmp_path):
    path, hf_model = hf_checkpoints[family]
    loop = load_pretrained(path)
    scanned = load_pretrained(path, config_overrides={"scan_layers": True, "remat": True})
    assert scanned.config.scan_layers and isinstance(scanned.model.layers, DecoderLayer)
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
    """A scanned base gets one adapter per target with a leading layer axis, drawn as the
    per-layer model's; the logits and adapter gradients equal the loop's."""
    from hybridjax.models.lora import LoRAConfig, apply_lora, split_trainable

    def grads(config):
        model = apply_lora(CausalLM(config, nnx.Rngs(0)), LoRAConfig(rank=2), seed=1)
        for adapter in model.adapters.values():  # B starts at 0: make the adapters count
            adapter.lora_b[...] = 0.02 * jnp.ones_like(adapter.lora_b[...])
        graphdef, state = nnx.split(model)
        trainable, frozen = split_trainable(state)
        loss = lambda t: _log_likelihood(nnx.merge(graphdef, nnx.merge_state(t, frozen)))

        value, g = jax.jit(jax.value_and_grad(loss))(trainable)
        return value, dict(nnx.to_flat_state(g))

    ref_value, ref_grads = grads(TINY)
    value, scanned_grads = grads(SCANNED)
    assert abs(float(value) - float(ref_value)) < 1e-5
    assert len(scanned_grads) == len(ref_grads) // 3
    for (_, key, ab), g in scanned_grads.items():
        assert g.get_value().shape[0] == 3
        for i in range(3):
            ref = ref_grads[("adapters", key.replace("layers.", f"layers.{i}."), ab)]
            np.testing.assert_allclose(g.get_value()[i], ref.get_value(), atol=1e-5)
    assert max(float(np.abs(g.get_value()).max()) for g in ref_grads.values()) > 1e-4
