"""HF export: refuses an occupied target, replaces it only with `overwrite`, and a crash in the
middle leaves the old export (and nothing else) in place."""

from __future__ import annotations

import os

import pytest
from flax import nnx

from configs.sft_arithmetic import TOKENIZER
from hybridjax.checkpointing.export import write_hf_export
from hybridjax.errors import ExportError
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained
from hybridjax.models.tokenizer import Tokenizer

EXPORT = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = Tokenizer.from_pretrained(TOKENIZER)
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=True,  # Qwen2's q/k/v biases
        tie_word_embeddings=True,
    )
    return CausalLM(config, nnx.Rngs(0)), tokenizer


def _files(path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def _occupied(tmp_path):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "model_backup_v1.safetensors").write_bytes(b"precious")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"shard")
    (target / "model.safetensors.index.json").write_text("{}")
    return target


def test_export_into_a_new_directory(tmp_path, model_and_tokenizer):
    write_hf_export(*model_and_tokenizer, str(tmp_path / "a" / "hf"))
    assert sorted(os.listdir(tmp_path / "a" / "hf")) == EXPORT
    assert sorted(os.listdir(tmp_path / "a")) == ["hf"]  # no temporary directory left
    load_pretrained(tmp_path / "a" / "hf")


def test_occupied_target_is_refused_untouched(tmp_path, model_and_tokenizer):
    target = _occupied(tmp_path)
    before = _files(target)
    with pytest.raises(ExportError, match=r"not empty \(model-00001.*--overwrite"):
        write_hf_export(*model_and_tokenizer, str(target))
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        write_hf_export(*model_and_tokenizer, str(tmp_path / "file"))


def test_overwrite_replaces_the_whole_directory(tmp_path, model_and_tokenizer):
    target = _occupied(tmp_path)
    write_hf_export(*model_and_tokenizer, str(target), overwrite=True)
    assert sorted(os.listdir(target)) == EXPORT
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_crash_while_writing_leaves_the_old_export(tmp_path, model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    target = tmp_path / "hf"
    write_hf_export(model, tokenizer, str(target))
    before = _files(target)

    def crash(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer, "save", crash)
    with pytest.raises(OSError, match="No space"):
        write_hf_export(model, tokenizer, str(target), overwrite=True)
    assert _files(target) == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the partial export was removed
