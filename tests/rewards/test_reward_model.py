"""Reward-model scoring: batched, jitted scores equal a forward without left padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridjax.models import ModelConfig, SequenceClassifier
from hybridjax.rewards.reward_model import place_on_last_token, score_responses, score_with_model

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
    num_labels=1,
)
P, R = 8, 6
PROMPT_LENGTHS = (8, 3, 5, 1)
RESPONSE_LENGTHS = (6, 2, 0, 4)


@pytest.fixture(scope="module")
def model():
    """Random weights everywhere (biases and head included) so that every input token matters;
    drawn with numpy into an abstract model (eager init would compile one op per shape)."""
    abstract = nnx.eval_shape(lambda: SequenceClassifier(CONFIG, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(1)
    state = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def batch():
    """Left-padded prompts, right-padded responses (pad id 0 never appears in real tokens)."""
    rng = np.random.default_rng(0)
    b = len(PROMPT_LENGTHS)
    prompts, prompt_mask = np.zeros((b, P), np.int32), np.zeros((b, P), np.int32)
    responses, response_mask = np.zeros((b, R), np.int32), np.zeros((b, R), np.int32)
    for i, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, strict=True)):
        prompts[i, P - p :], prompt_mask[i, P - p :] = rng.integers(1, 64, p), 1
        responses[i, :r], response_mask[i, :r] = rng.integers(1, 64, r), 1
    return prompts, prompt_mask, responses, response_mask


def _reference_scores(model, prompts, prompt_mask, responses, response_mask):
    """Each row's real tokens moved to the front (no left padding), one batched forward, the
    score at each row's last real token: causal attention makes trailing padding irrelevant."""
    b, length = len(prompts), P + R
    ids, mask, last = np.zeros((b, length), np.int32), np.zeros((b, length), np.int32), []
    for i in range(b):
        row = np.concatenate([prompts[i][prompt_mask[i] == 1], responses[i][response_mask[i] == 1]])
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
        last.append(len(row) - 1)
    scores = np.asarray(
        nnx.jit(lambda m, i, k: m(i, k))(model, jnp.asarray(ids), jnp.asarray(mask))
    )
    return scores[np.arange(b), last, 0]


def test_scores_equal_unpadded_forward(model, batch):
    token_level, scores = score_with_model(model, *batch)
    expected = _reference_scores(model, *batch)
    np.testing.assert_allclose(np.asarray(scores), expected, atol=1e-5)
    assert np.std(expected) > 1e-3  # rows differ, so the comparison is not vacuous
    token_level = np.asarray(token_level)
    assert token_level.shape == (4, R) and token_level.dtype == np.float32
    for i, r in enumerate(RESPONSE_LENGTHS):
        nonzero = np.nonzero(token_level[i])[0].tolist()
        assert nonzero == ([r - 1] if r else [])
        if r:
            assert token_level[i, r - 1] == pytest.approx(float(scores[i]))


def test_micro_batches_give_the_same_scores(model, batch):
    graphdef, state = nnx.split(model)
    full = score_responses(graphdef, state, *batch)
    micro = score_responses(graphdef, state, *batch, micro_batch_size=2)
    np.testing.assert_allclose(np.asarray(micro[1]), np.asarray(full[1]), atol=1e-6)
    with pytest.raises(ValueError, match="micro_batch_size 3 does not divide"):
        score_responses(graphdef, state, *batch, micro_batch_size=3)


def test_place_on_last_token():
    mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = place_on_last_token(jnp.array([2.0, 3.0, -1.0]), mask)
    np.testing.assert_array_equal(np.asarray(out), [[0, 2.0, 0], [0, 0, 0], [0, 0, -1.0]])
