"""Data metrics against hand-computed values, FLOP counts, and the three loggers."""

from __future__ import annotations

import json
import types

import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.metrics import Tracking, compute_data_metrics, console_line, training_flops
from hybridjax.metrics.perf import compute_perf_metrics
from hybridjax.models.config import ModelConfig


def _batch():
    # 2 rows, prompts of width 3 (lengths 2 and 3), responses of width 4 (lengths 4 and 1).
    response_mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    prompt_mask = jnp.array([[0, 1, 1], [1, 1, 1]], jnp.int32)
    scores = jnp.array([[0, 0, 0, 1.0], [0.5, 0, 0, 0]])
    return types.SimpleNamespace(
        prompts=jnp.zeros((2, 3), jnp.int32),
        response_mask=response_mask,
        attention_mask=jnp.concatenate([prompt_mask, response_mask.astype(jnp.int32)], 1),
        token_level_scores=scores,
        token_level_rewards=scores - 0.1,
        advantages=jnp.array([[1.0, 2, 3, 4], [-5, 99, 99, 99]]),
        returns=jnp.array([[1.0, 1, 1, 1], [0.5, 0, 0, 0]]),
        values=jnp.array([[1.0, 1, 1, 0], [0.5, 7, 7, 7]]),
    )


def test_data_metrics_hand_values():
    m = {k: float(v) for k, v in compute_data_metrics(_batch(), use_critic=True).items()}
    assert m["critic/score/mean"] == pytest.approx(0.75)
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.5
    # rewards: row sums over valid tokens: 1 − 0.4 = 0.6 and 0.5 − 0.1 = 0.4
    assert m["critic/rewards/mean"] == pytest.approx(0.5)
    # advantages over the 5 valid tokens (1, 2, 3, 4, −5); padding (99) ignored
    assert m["critic/advantages/mean"] == pytest.approx(1.0)
    assert m["critic/advantages/max"] == 4.0 and m["critic/advantages/min"] == -5.0
    # explained variance: returns (1,1,1,1,.5) var .04; residual (0,0,0,1,0) var .16
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.16 / (0.04 + 1e-5), rel=1e-5)
    assert m["response_length/mean"] == 2.5 and m["response_length/max"] == 4.0
    assert m["response_length/clip_ratio"] == 0.5  # one row hit the response width
    assert m["prompt_length/mean"] == 2.5 and m["prompt_length/clip_ratio"] == 0.5


def test_training_flops_formula():
    config = ModelConfig(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    # layer: attn 8·4·(2+2) + 2·4·8 = 192, mlp 3·8·16 = 384, norms 16 → 592; final norm 8;
    # LM head 100·8 = 800 → N = 1400 matmul parameters.
    lens = np.array([3, 5])
    expected = 6 * 1400 * 8 + 12 * (9 + 25) * 4 * 2 * 1
    assert training_flops(config, lens) == expected
    perf = compute_perf_metrics(lens, {"step": 2.0, "update_actor": 1.0}, 4, config, 1, 1e6)
    assert perf["perf/throughput"] == 1.0  # 8 tokens / 2 s / 4 devices
    assert perf["perf/mfu/actor"] == pytest.approx(expected / 4e6)


def test_tracking_writes_jsonl_tensorboard_and_console(tmp_path, capsys):
    tracker = Tracking(("console", "jsonl", "tensorboard"), str(tmp_path), 2, progress_bar=False)
    tracker.log(
        {"critic/score/mean": 0.5, "timing_s/step": 1.25, "actor/pg_loss": np.float32(2)}, 1
    )
    tracker.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {
        "step": 1,
        "critic/score/mean": 0.5,
        "timing_s/step": 1.25,
        "actor/pg_loss": 2.0,
    }
    assert list((tmp_path / "tensorboard" / "run").glob("events.out.tfevents.*"))
    assert "step 1 | score 0.5 | pg_loss 2 | step_s 1.25" in capsys.readouterr().out
    assert console_line(3, {"val-core/openai/gsm8k/acc/mean@1": 0.25}).endswith(
        "openai/gsm8k/acc/mean@1 0.25"
    )
    with pytest.raises(ValueError, match="unknown loggers \\['mlflow'\\]"):
        Tracking(("mlflow",), str(tmp_path), 1)


def test_num_compiles_counts_new_shapes_not_cache_hits():
    import jax

    from hybridjax.metrics import num_compiles

    a, b, c = (jax.device_put(np.full(n, v, np.float32)) for n, v in ((3, 1), (3, 0), (5, 1)))
    start, _ = num_compiles()
    f = jax.jit(lambda x: x * 3.0 + 1.0)
    f(a).block_until_ready()
    first, _ = num_compiles()
    f(b).block_until_ready()  # same shape: the compiled program is reused
    same, _ = num_compiles()
    f(c).block_until_ready()  # a new shape compiles again
    new_shape, seconds = num_compiles()
    assert first == start + 1
    assert same == first
    assert new_shape == first + 1
    assert seconds > 0.0
