"""GPU checks, run for real on a GPU by `experiments/gpu/check.sh` (skipped without one).

What runs where: the Pallas paged-attention kernel (decode) runs on GPU only and is checked
against the jnp gather path, the CPU path and test oracle; cuDNN attention
(`jax.nn.dot_product_attention(implementation="cudnn")`, bfloat16) against the jnp attention
the model uses; and the model in bfloat16 against float32 and against `transformers`.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.models.attention import attention_bias, attention_mask, grouped_attention
from hybridjax.rollout.paged_cache import paged_attention_jnp, paged_attention_pallas

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu():
    return jax.devices("gpu")[0]


def _pages(rng, b, h, kv, d, pages, page, dtype):
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(kv, pages, page, d)), dtype)
    v = jnp.asarray(rng.normal(size=(kv, pages, page, d)), dtype)
    table = jnp.asarray(rng.permutation(pages)[: b * 8].reshape(b, 8), jnp.int32)
    positions = jnp.asarray(rng.integers(1, 8 * page, size=(b, 1)), jnp.int32)
    return q, k, v, table, positions


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)])
def test_pallas_paged_attention_matches_jnp_on_gpu(gpu, dtype, atol):
    with jax.default_device(gpu):
        args = _pages(np.random.default_rng(0), 4, 8, 2, 64, 64, 16, dtype)
        got = jax.jit(paged_attention_pallas)(*args)
        expect = jax.jit(paged_attention_jnp)(*args)
    assert got.devices() == {gpu}
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(expect, np.float32), atol=atol, rtol=0
    )


def test_cudnn_attention_matches_the_models_jnp_attention(gpu):
    b, t, h, kv, d = 2, 128, 8, 2, 64
    rng = np.random.default_rng(1)
    with jax.default_device(gpu):
        q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16) for n in (h, kv, kv))
        positions = jnp.tile(jnp.arange(t), (b, 1))
        valid = jnp.ones((b, t), bool)
        bias = attention_bias(attention_mask(positions, positions, valid, None))
        ours = grouped_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), bias)  # fmt: skip
        ours = ours.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)  # B×K×T×G×D → B×T×H×D
        cudnn = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=d**-0.5, implementation="cudnn"
        )
    np.testing.assert_allclose(np.asarray(cudnn, np.float32), np.asarray(ours), atol=3e-2)


def _hf_qwen2(tmp_path):
    import transformers
    from hf_testing import COMMON, write_hf_model

    config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    return write_hf_model(tmp_path, transformers.Qwen2ForCausalLM, config)


def _batch():
    rng = np.random.default_rng(2)
    mask = np.ones((3, 20), np.int64)
    mask[1, :7] = mask[2, :15] = 0
    from hf_testing import VOCAB

    ids = rng.integers(1, VOCAB, mask.shape) * mask
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def test_bfloat16_logits_match_float32_and_transformers(gpu, tmp_path):
    from hf_testing import hf_logits, max_valid_diff, our_logits

    from hybridjax.models import load_pretrained

    hf = _hf_qwen2(tmp_path)
    batch = _batch()
    reference = hf_logits(hf, *batch)
    with jax.default_device(gpu):
        f32 = our_logits(load_pretrained(tmp_path), batch)
        bf16 = our_logits(load_pretrained(tmp_path, config_overrides={"dtype": "bfloat16"}), batch)
    scale = float(np.abs(reference).max())
    assert max_valid_diff(f32, reference, batch[1]) < 1e-3 * scale  # TF32 off: highest precision
    assert max_valid_diff(bf16, f32, batch[1]) < 5e-2 * scale
    assert max_valid_diff(bf16, reference, batch[1]) < 5e-2 * scale
    valid = batch[1].astype(bool)
    agree = (bf16.argmax(-1) == reference.argmax(-1))[valid].mean()
    assert agree > 0.9, agree
