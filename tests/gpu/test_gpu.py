"""GPU checks, run for real on a GPU by `experiments/gpu/check.sh` (skipped without one).

What runs where: our Pallas paged-attention kernel (decode, the GPU default) runs on GPU only
and is checked against the jnp gather path, the test oracle, on one layer's pool and at a layer
of stacked pools; the blocked self-attention of
training passes (the GPU's default, `hybridjax.models.blocked_attention`) against the dense jnp
path on packed shared-prompt buffers (outputs and gradients, float32 and bfloat16), with its
compiled GPU memory growing linearly in tokens; and the model in bfloat16 against float32 and
against `transformers`.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridjax.models.attention import SelfAttentionMask, attention_backend
from hybridjax.rollout.decode_attention import paged_attention_jnp
from hybridjax.rollout.paged_kernel import paged_attention_kernel

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
        q, k, v, table, positions = _pages(np.random.default_rng(0), 4, 8, 2, 64, 64, 16, dtype)
        stacked_k, stacked_v = jnp.stack([v, k]), jnp.stack([k, v])  # layer 1 holds k, v
        for args, layer in (((k, v), None), ((stacked_k, stacked_v), jnp.int32(1))):
            got = jax.jit(paged_attention_kernel)(q, *args, table, positions, layer)
            expect = jax.jit(paged_attention_jnp)(q, k, v, table, positions)
            assert got.devices() == {gpu}
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(expect, np.float32), atol=atol, rtol=0
            )


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)])
def test_blocked_attention_matches_the_dense_path_on_gpu(gpu, dtype, atol):
    from test_blocked_attention import attention_loss, packed_buffers, random_qkv

    with jax.default_device(gpu):
        assert attention_backend() == "blocked"
        ids = packed_buffers(0)
        q, k, v = random_qkv(ids[0].shape, 0)
        dense = SelfAttentionMask.create(ids[2], ids[3], ids[:2], None, impl="jnp")
        (_, out_ref), g_ref = attention_loss(dense)(q, k, v)  # float32 reference on the same device
        blocked = SelfAttentionMask.create(ids[2], ids[3], ids[:2], None, impl="blocked")
        cast = lambda x: x.astype(dtype)
        (_, out), g = attention_loss(blocked)(cast(q), cast(k), cast(v))
    assert out.devices() == {gpu}
    f32 = lambda x: np.asarray(x, np.float32)
    np.testing.assert_allclose(f32(out), f32(out_ref), atol=atol, rtol=0)
    for a, b in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(f32(a), f32(b), atol=atol * 4, rtol=0)


def test_blocked_attention_memory_grows_linearly_on_gpu(gpu):
    from test_blocked_attention import scratch_bytes

    with jax.default_device(gpu):
        blocked = [scratch_bytes("blocked", t) for t in (4096, 8192)]
        dense = [scratch_bytes("jnp", t) for t in (4096, 8192)]
    print(f"GPU temp bytes at T=4096, 8192: blocked {blocked}, dense {dense}")
    assert blocked[1] / blocked[0] < 2.3, blocked
    assert blocked[1] < dense[1] / 4, (blocked, dense)


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
