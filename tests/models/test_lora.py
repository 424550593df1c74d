"""LoRA: merged forward = base + (alpha/rank)·A·B, gradients reach adapters only, the reference
is the base, the re-layout merges, and peft loads our adapter with the same logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import save_pretrained
from hybridjax.models.lora import (
    LINEAR_MODULES,
    LoRAConfig,
    adapters_off,
    apply_lora,
    merge_trainable,
    merged_model,
    save_peft_adapter,
    split_trainable,
)
from hybridjax.sharding import update_weights

CONFIG = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    pad_token_id=0,
)
LORA = LoRAConfig(rank=4, alpha=8.0)
SCAN = pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])


def _model(seed=0, lora=LORA, scan=False):
    """Adapted model; `scan`: on a scanned base (stacked layers, stacked adapters)."""
    config = dataclasses.replace(CONFIG, scan_layers=scan)
    model = apply_lora(CausalLM(config, nnx.Rngs(seed)), lora, seed=seed + 1)
    for adapter in model.adapters.values():  # B starts at 0; make the adapters do something
        key = jax.random.key(hash(id(adapter)) % 2**31)
        adapter.lora_b[...] = 0.1 * jax.random.normal(key, adapter.lora_b[...].shape)
    return model


def _batch():
    rng = np.random.default_rng(0)
    mask = np.ones((2, 9), np.int32)
    mask[1, :3] = 0
    return jnp.asarray(rng.integers(1, 97, (2, 9)) * mask), jnp.asarray(mask)


@SCAN
def test_merged_forward_is_base_plus_scaled_low_rank(scan):
    model = _model(scan=scan)
    ids, mask = _batch()
    graphdef, state = nnx.split(model.base)
    flat = dict(nnx.to_flat_state(state))
    expected = dict(flat)
    for key, adapter in model.adapters.items():
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        w = np.asarray(flat[path].get_value())
        a, b = np.asarray(adapter.lora_a[...]), np.asarray(adapter.lora_b[...])
        expected[path] = flat[path].replace(jnp.asarray(w + 2.0 * (a @ b).reshape(w.shape)))
    hand = nnx.merge(graphdef, nnx.from_flat_state(expected))
    np.testing.assert_allclose(model(ids, mask), hand(ids, mask), atol=1e-5)
    assert not np.allclose(model(ids, mask), model.base(ids, mask), atol=1e-3)
    assert len(model.adapters) == len(LINEAR_MODULES) * (1 if scan else CONFIG.num_hidden_layers)


def test_target_modules_and_config_errors():
    model = apply_lora(CausalLM(CONFIG, nnx.Rngs(0)), LoRAConfig(2, 4.0, ("q_proj", "v_proj")))
    assert sorted({k.split(".")[-1] for k in model.adapters}) == ["q_proj", "v_proj"]

    class Cfg:
        lora_rank, lora_alpha, target_modules = 8, 16.0, "q_proj,lm_head"

    with pytest.raises(ValueError, match="lm_head"):
        LoRAConfig.from_config(Cfg)
    Cfg.target_modules = "all-linear"
    assert LoRAConfig.from_config(Cfg).target_modules == LINEAR_MODULES


def test_gradients_reach_adapters_only_and_reference_is_base():
    model = _model()
    ids, mask = _batch()
    graphdef, state = nnx.split(model)
    trainable, frozen = split_trainable(state)
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(trainable))

    def loss(t):
        return nnx.merge(graphdef, merge_trainable(t, frozen))(ids, mask).sum()

    grads = jax.grad(loss)(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
    ref = nnx.merge(graphdef, adapters_off(state))
    np.testing.assert_array_equal(ref(ids, mask), model.base(ids, mask))


@SCAN
def test_relayout_merges_and_turns_the_copy_adapters_off(scan):
    model = _model(scan=scan)
    ids, mask = _batch()
    graphdef, state = nnx.split(model)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    gen, nbytes = update_weights(state, shardings)
    gen_model = nnx.merge(graphdef, gen)
    np.testing.assert_allclose(gen_model.base(ids, mask), model(ids, mask), atol=1e-5)
    np.testing.assert_allclose(gen_model(ids, mask), model(ids, mask), atol=1e-5)  # scale 0
    assert nbytes > 0


@SCAN
def test_peft_loads_exported_adapter_with_same_logits(tmp_path, scan):
    """Also from a scanned model: its stacked adapters are exported one pair per layer."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    model = _model(scan=scan)
    save_pretrained(model.base, tmp_path / "base")
    save_peft_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    save_pretrained(merged_model(model), tmp_path / "merged")
    ids, mask = _batch()
    ours = np.asarray(model(ids, mask))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        t_ids = torch.tensor(np.asarray(ids))
        t_mask = torch.tensor(np.asarray(mask))
        theirs = peft_model(input_ids=t_ids, attention_mask=t_mask).logits.numpy()
        merged = merged_hf(input_ids=t_ids, attention_mask=t_mask).logits.numpy()
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(theirs[valid], ours[valid], atol=1e-5)
    np.testing.assert_allclose(merged[valid], ours[valid], atol=1e-5)


def test_trainer_config_check_names_lora_keys(tmp_path):
    from hybridjax.config.checks import ConfigError
    from hybridjax.rl.checks import validate
    from tests.rl.test_trainer_config import ACTOR, _load

    config = _load("tiny", tmp_path)
    config.actor_rollout_ref.model.lora_rank = 8
    config.actor_rollout_ref.model.target_modules = "q_proj,qkv"
    with pytest.raises(ConfigError, match=r"target_modules: unknown \['qkv'\]"):
        validate(config, 8, ACTOR)
