"""Checkpoint errors name what is wrong: the tensor and both shapes, the path, the choices."""

import json
import logging
import re
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hybridjax.models.hf_io import load_pretrained


@pytest.fixture
def qwen2_copy(hf_checkpoints, tmp_path):
    """A writable copy of the tiny Qwen2 checkpoint (untied here would need lm_head: it is tied)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["qwen2"][0], dst)
    return dst


@pytest.fixture
def llama_copy(hf_checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"][0], dst)
    return dst


def _edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path, **changes):
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_missing_config_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        load_pretrained(tmp_path)


def test_missing_weights_name_paths(qwen2_copy):
    (qwen2_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_pretrained(qwen2_copy)
    assert str(qwen2_copy / "model.safetensors") in str(err.value)
    assert str(qwen2_copy / "model.safetensors.index.json") in str(err.value)


def test_missing_shard_names_path(qwen2_copy):
    names = list(load_file(str(qwen2_copy / "model.safetensors")))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    (qwen2_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00001.safetensors"):
        load_pretrained(qwen2_copy)


def test_missing_tensor_is_named_with_its_shape(qwen2_copy):
    _edit_tensors(qwen2_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        ValueError, match=re.escape("'model.layers.1.self_attn.k_proj.bias'")
    ) as err:
        load_pretrained(qwen2_copy)
    assert "missing" in str(err.value) and "(32,)" in str(err.value)


def test_unexpected_tensor_is_named(qwen2_copy):
    _edit_tensors(qwen2_copy, lambda t: t.update({"model.extra.weight": np.zeros((3, 5), "f4")}))
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'model.extra.weight' with shape \(3, 5\)"
    ):
        load_pretrained(qwen2_copy)


def test_shape_mismatch_names_tensor_and_both_shapes(qwen2_copy):
    _edit_config(qwen2_copy, intermediate_size=80)
    with pytest.raises(ValueError) as err:
        load_pretrained(qwen2_copy)
    msg = str(err.value)
    assert re.search(
        r"'model.layers.0.mlp.up_proj.weight' has shape \(96, 64\) in the checkpoint but the "
        r"model expects \(80, 64\)",
        msg,
    ), msg


def test_untied_checkpoint_loaded_as_tied_reports_lm_head(llama_copy):
    _edit_config(llama_copy, tie_word_embeddings=True)
    _edit_tensors(llama_copy, lambda t: t.pop("lm_head.weight"))
    load_pretrained(llama_copy)  # tied: no lm_head needed
    _edit_config(llama_copy, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head.weight' .*\(128, 64\)"):
        load_pretrained(llama_copy)


def test_unsupported_architecture_lists_supported(qwen2_copy):
    _edit_config(qwen2_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_pretrained(qwen2_copy)
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"):
        assert arch in str(err.value)


def test_unknown_kind_lists_kinds(qwen2_copy):
    with pytest.raises(ValueError, match="causal_lm.*classifier"):
        load_pretrained(qwen2_copy, kind="value_head")


def test_causal_lm_as_classifier_needs_the_flag(llama_copy, caplog):
    with pytest.raises(ValueError) as err:
        load_pretrained(llama_copy, kind="classifier")
    assert "missing tensor 'score.weight'" in str(err.value)
    assert "unexpected tensor 'lm_head.weight'" in str(err.value)

    with caplog.at_level(logging.WARNING, logger="hybridjax.models.hf_io"):
        critic = load_pretrained(llama_copy, kind="classifier", init_score_head=True, seed=3)
    assert "score.weight" in caplog.text
    actor = load_pretrained(llama_copy)
    score = np.asarray(critic.score[...])
    assert score.shape == (64, 1) and critic.config.num_labels == 1
    assert 0.01 < score.std() < 0.04  # N(0, 0.02²)
    backbone = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(actor.model))}
    for p, v in nnx.to_flat_state(nnx.state(critic.model)):
        np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(backbone[p]))


def test_integer_weights_are_refused_naming_file_and_tensor(qwen2_copy):
    def to_int(tensors):
        for name in list(tensors)[:3]:
            tensors[name] = tensors[name].astype(np.int32)

    _edit_tensors(qwen2_copy, to_int)
    with pytest.raises(ValueError) as err:
        load_pretrained(qwen2_copy)
    message = str(err.value)
    assert f"checkpoint {qwen2_copy}: weights must be floating point" in message
    assert "(I32, in model.safetensors)" in message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_weights_name_the_file(qwen2_copy, keep):
    file = qwen2_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=re.escape(f"{file}") + ".*not a readable safetensors"):
        load_pretrained(qwen2_copy)
