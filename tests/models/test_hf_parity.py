"""Logits parity with `transformers` (torch CPU) and checkpoint round trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_testing import COMMON, hf_logits, max_valid_diff, our_logits, write_hf_model
from safetensors import safe_open

from hybridjax.models.hf_io import load_pretrained, save_pretrained

PARITY_TOL = 1e-4
MEASURED: dict[
    str, float
] = {}  # family -> max |Δlogit|, printed at the end of the module (run with -s)


def _params(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    """family -> our CausalLM loaded from the HF checkpoint."""
    return {family: load_pretrained(path) for family, (path, _) in hf_checkpoints.items()}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nmax |Δlogit| vs transformers:", {k: f"{v:.2e}" for k, v in MEASURED.items()})


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_logits_match_transformers(family, scan, hf_checkpoints, loaded, padded_batch):
    """Per-layer and scanned (stored-stacked layers, `scan_layers`) models alike."""
    path, hf_model = hf_checkpoints[family]
    model = load_pretrained(path, config_overrides={"scan_layers": True}) if scan else None
    ref = hf_logits(hf_model, *padded_batch)
    ours = our_logits(model or loaded[family], padded_batch)
    err = max_valid_diff(ours, ref, padded_batch[1])
    MEASURED[family + ("/scan" if scan else "")] = err
    assert np.abs(ref).max() > 1.0  # logits are not trivially small
    assert err <= PARITY_TOL


def test_what_parity_exercises(hf_checkpoints, loaded):
    """The features each family is there for are really on."""
    q, ll, mi = (loaded[f].config for f in ("qwen2", "llama", "mistral"))
    assert q.attention_bias and q.tie_word_embeddings and not hasattr(loaded["qwen2"], "lm_head")
    assert np.abs(np.asarray(loaded["qwen2"].model.layers[0].self_attn.q_bias[...])).max() > 0.1
    assert not ll.tie_word_embeddings and ll.num_key_value_heads < ll.num_attention_heads
    assert ll.rope_scaling_dict["rope_type"] == "llama3"
    assert mi.sliding_window == 8


@pytest.mark.parametrize(
    "family, change", [("llama", {"rope_scaling": None}), ("mistral", {"sliding_window": None})]
)
def test_parity_is_sensitive(family, change, hf_checkpoints, padded_batch):
    """Dropping llama3 scaling or the sliding window moves the logits far beyond tolerance."""
    path, hf_model = hf_checkpoints[family]
    altered = load_pretrained(path, config_overrides=change)
    ref = hf_logits(hf_model, *padded_batch)
    assert max_valid_diff(our_logits(altered, padded_batch), ref, padded_batch[1]) > 1e-2


def test_classifier_scores_match_transformers(tmp_path, padded_batch):
    """Qwen2ForSequenceClassification: per-token scores and HF's pooled (last token) scores."""
    config = transformers.Qwen2Config(**COMMON, num_labels=2)
    hf_model = write_hf_model(tmp_path, transformers.Qwen2ForSequenceClassification, config)
    ids, mask, positions = padded_batch
    with torch.no_grad():
        hidden = hf_model.model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).last_hidden_state
        ref_tokens = hf_model.score(hidden).numpy()
        ref_pooled = hf_model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    model = load_pretrained(tmp_path, kind="classifier")
    assert model.config.num_labels == 2
    scores = our_logits(model, padded_batch)
    err = max_valid_diff(scores, ref_tokens, mask)
    MEASURED["qwen2-classifier"] = err
    assert err <= PARITY_TOL
    last_token_scores = nnx.jit(lambda m, i, k: m.last_token_scores(i, k))
    pooled = np.asarray(last_token_scores(model, jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_allclose(pooled, ref_pooled, atol=PARITY_TOL)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_export_loads_in_transformers(family, tmp_path, hf_checkpoints, loaded, padded_batch):
    _, hf_model = hf_checkpoints[family]
    save_pretrained(loaded[family], tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    assert reloaded.config.tie_word_embeddings == (family == "qwen2")
    for name, p in hf_model.state_dict().items():  # the very same numbers came back
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
    np.testing.assert_array_equal(
        hf_logits(reloaded, *padded_batch), hf_logits(hf_model, *padded_batch)
    )


def test_tied_embeddings_saved_once_and_reload_tied(tmp_path, loaded, padded_batch):
    save_pretrained(loaded["qwen2"], tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    reloaded_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded_hf.lm_head.weight.data_ptr() == reloaded_hf.model.embed_tokens.weight.data_ptr()
    ours = load_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings and not hasattr(ours, "lm_head")
    np.testing.assert_array_equal(
        our_logits(ours, padded_batch), our_logits(loaded["qwen2"], padded_batch)
    )


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_load_save_load_is_bit_identical(family, tmp_path, loaded):
    save_pretrained(loaded[family], tmp_path)
    again = load_pretrained(tmp_path)
    assert again.config == loaded[family].config
    first, second = _params(loaded[family]), _params(again)
    assert first.keys() == second.keys()
    for path in first:
        np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))


def test_sharded_checkpoints_both_ways(tmp_path, hf_checkpoints, loaded, padded_batch):
    """HF-written shards load; ours split by max_shard_size_bytes, index and all, load in HF."""
    _, hf_model = hf_checkpoints["llama"]
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    from_shards = load_pretrained(tmp_path / "hf")
    for path, value in _params(loaded["llama"]).items():
        np.testing.assert_array_equal(_params(from_shards)[path], value)

    save_pretrained(from_shards, tmp_path / "ours", max_shard_size_bytes=100_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and not (tmp_path / "ours" / "model.safetensors").exists()
    n_params = loaded["llama"].config.num_params()
    assert index["metadata"]["total_size"] == 4 * n_params
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(
        hf_logits(reloaded, *padded_batch), hf_logits(hf_model, *padded_batch)
    )


def test_bf16_checkpoint_loads_and_saves(tmp_path, hf_checkpoints):
    config, cls = transformers.Qwen2Config(**COMMON), transformers.Qwen2ForCausalLM
    write_hf_model(tmp_path / "bf16", cls, config, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        ref = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert ref.dtype == torch.bfloat16
    as_f32 = load_pretrained(tmp_path / "bf16")
    up = as_f32.model.layers[0].mlp.up_proj[...]
    assert up.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(up), ref.float().numpy().T)  # exact widening

    as_bf16 = load_pretrained(tmp_path / "bf16", config_overrides={"param_dtype": "bfloat16"})
    assert as_bf16.model.layers[0].mlp.up_proj[...].dtype == jnp.bfloat16
    save_pretrained(as_bf16, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.mlp.up_proj.weight"), ref)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert hf.config.dtype == torch.bfloat16


def test_loaded_arrays_live_on_default_device(loaded):
    leaves = jax.tree.leaves(nnx.state(loaded["qwen2"], nnx.Param))
    assert all(x.devices() == {jax.devices()[0]} for x in leaves)


def test_token_classifier_with_bias_round_trips(tmp_path, padded_batch):
    """verl's critic is HF `*ForTokenClassification`: `score.weight` plus `score.bias`."""
    config = transformers.LlamaConfig(**COMMON, num_labels=1)
    hf_model = write_hf_model(tmp_path / "hf", transformers.LlamaForTokenClassification, config)
    ids, mask, positions = (torch.tensor(x) for x in padded_batch)
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()
    model = load_pretrained(tmp_path / "hf", kind="classifier")
    assert model.config.score_bias and abs(float(model.score_bias[...][0])) > 0
    err = max_valid_diff(our_logits(model, padded_batch), ref, padded_batch[1])
    MEASURED["llama-token-classifier"] = err
    assert err <= PARITY_TOL
    save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "ours")
    assert type(reloaded).__name__ == "LlamaForTokenClassification"
    for name, p in hf_model.state_dict().items():
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), p.numpy(), err_msg=name)
