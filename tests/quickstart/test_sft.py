"""SFT: response-only loss mask, the loss against a numpy reference, a short run that learns,
its HF export, and resume."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.sft_arithmetic import TOKENIZER
from hybridjax.errors import ExportError
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.models.hf_io import load_pretrained
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.offline.sft import (
    batch_indices,
    check_keys,
    run_sft,
    sft_config,
    sft_loss,
    tokenize_pairs,
)

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(TOKENIZER)


def test_loss_mask_covers_response_and_eos_only(tokenizer):
    pairs = [("He has 3 cups and gets 4 more. How many cups now?", "#### 7")]
    out = tokenize_pairs(pairs, tokenizer, 40, "error")
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": pairs[0][0]}]))
    response = tokenizer.encode("#### 7")
    n = len(prompt) + len(response) + 1
    ids, mask, loss = out["input_ids"][0], out["attention_mask"][0], out["loss_mask"][0]
    assert list(ids[: len(prompt)]) == prompt
    assert list(ids[len(prompt) : n]) == response + [tokenizer.eos_token_id]
    assert mask.sum() == n and mask[:n].all()
    assert loss.sum() == len(response) + 1 and loss[len(prompt) : n].all()
    assert (ids[n:] == tokenizer.pad_token_id).all()


def test_too_long_pair_names_the_row(tokenizer):
    pairs = [("short", "#### 1"), ("a much longer prompt " * 5, "#### 2")]
    with pytest.raises(ValueError, match="f.parquet row 1: .* data.max_length=24"):
        tokenize_pairs(pairs, tokenizer, 24, "error", "f.parquet")
    out = tokenize_pairs(pairs, tokenizer, 24, "right")
    assert out["attention_mask"][1].all()


def test_batch_indices_cover_each_epoch_once():
    rows = np.concatenate([batch_indices(10, 3, s, seed=5) for s in range(3)])
    assert len(set(rows)) == 9  # one epoch: 3 full batches, the last row dropped
    assert (batch_indices(10, 3, 4, 5) == batch_indices(10, 3, 4, 5)).all()
    assert not (batch_indices(10, 3, 0, 5) == batch_indices(10, 3, 3, 5)).all()  # new epoch


def test_sft_loss_matches_numpy():
    config = ModelConfig(vocab_size=50, **TINY)
    model = CausalLM(config, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (2, 7)).astype(np.int32)
    attention = np.ones((2, 7), np.int32)
    attention[1, 5:] = 0
    loss_mask = np.zeros((2, 7), np.float32)
    loss_mask[0, 3:] = 1
    loss_mask[1, 2:5] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    total, count = sft_loss(graphdef, params, jax.tree.map(jnp.asarray, batch))
    logits = np.asarray(model(ids, attention), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = 0.0
    for b, t in zip(*np.nonzero(loss_mask[:, 1:]), strict=True):
        expected -= logp[b, t, ids[b, t + 1]]
    assert count == 4 + 3
    np.testing.assert_allclose(float(total), expected, rtol=1e-5)


def _write_pairs(path, n):
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, (3 * i) % 10
            prompt = [{"role": "user", "content": f"He has {a} cups and gets {b} more."}]
            f.write(json.dumps({"prompt": prompt, "response": f"#### {a + b}"}) + "\n")


def _config(tmp_path, steps, **trainer):
    c = sft_config()
    c.data.train_files = str(tmp_path / "train.jsonl")
    c.data.val_files = str(tmp_path / "train.jsonl")
    c.data.tokenizer = TOKENIZER
    c.data.max_length = 32
    c.data.train_batch_size = 16
    c.model.override_config = TINY
    c.optim.lr = 3e-3
    c.optim.lr_warmup_steps = 2
    c.optim.total_training_steps = 12
    c.trainer.total_training_steps = steps
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.logger = ("jsonl",)
    for key, value in trainer.items():
        c.trainer[key] = value
    return c


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    _write_pairs(tmp / "train.jsonl", 64)
    metrics = run_sft(_config(tmp, 12))
    return tmp, metrics


def test_short_run_learns_and_exports(short_run):
    tmp, metrics = short_run
    with open(tmp / "run" / "logs" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["train/loss"] < 0.85 * records[0]["train/loss"]
    assert records[0]["train/lr"] == 0.0 and records[1]["train/lr"] == pytest.approx(1.5e-3)
    assert "val/loss" in metrics and np.isfinite(metrics["val/loss"])
    hf = tmp / "run" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    loaded = load_pretrained(hf)
    assert loaded.config.num_hidden_layers == 2 and loaded.config.hidden_size == 32
    assert Tokenizer.from_pretrained(hf).chat_template


@pytest.mark.slow
def test_resume_continues_exactly(short_run, tmp_path):
    straight, _ = short_run
    _write_pairs(tmp_path / "train.jsonl", 64)
    run_sft(_config(tmp_path, 6, save_freq=3))
    with pytest.raises(ExportError, match="not empty"):  # the 6-step export is there
        run_sft(_config(tmp_path, 12, save_freq=3))
    run_sft(_config(tmp_path, 12, save_freq=3), overwrite=True)  # resumes at step 6
    a = load_pretrained(straight / "run" / "hf")
    b = load_pretrained(tmp_path / "run" / "hf")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_unknown_key_is_named():
    c = sft_config()
    c.data.nope = 1
    c.trainer.also_nope = 2
    with pytest.raises(ValueError, match="data.nope, trainer.also_nope"):
        check_keys(c)
