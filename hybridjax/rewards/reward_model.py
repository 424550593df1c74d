"""Reward-model scoring: a `SequenceClassifier` reads prompt + response, scores the last token.

The reward model is co-located with the other models and shares the actor's tokenizer, so the
rollout's token ids are scored as they are (no re-tokenisation): the left-padded prompt and the
right-padded response are concatenated into `[pad… prompt response …pad]`, positions count real
tokens only, and the score is read at the last real token (HF's pooling for
`*ForSequenceClassification`). Like a rule-based reward, the score is then placed on the last valid
response token; an empty response gets none (docs/verl_behaviour.md, "Rewards").

One jitted function per shape; micro-batches run as a `lax.map` inside it (bounded activation
memory, no host round trip between them). With a `PackingConfig` the pairs are packed instead
(`hybridjax.models.packing`: no padding, consecutive rows with the same prompt share one copy,
buffers of a token budget in a `lax.while_loop`); the scores are the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybridjax.models import packing as packing_lib
from hybridjax.models.decoder import SequenceClassifier


def place_on_last_token(scores_B: jax.Array, response_mask_BxR: jax.Array) -> jax.Array:
    """B×R float32: `scores[i]` at the last valid response token of row i, 0 elsewhere.

    The response mask is a right-padded prefix mask; a row with no valid token stays all zero.
    """
    lengths = jnp.sum(response_mask_BxR.astype(jnp.int32), axis=1)
    # one_hot(-1) is all zeros, which is exactly the empty-response case.
    last_BxR = jax.nn.one_hot(lengths - 1, response_mask_BxR.shape[1], dtype=jnp.float32)
    return last_BxR * scores_B.astype(jnp.float32)[:, None]


def _sequence_scores(model: SequenceClassifier, ids_BxL, mask_BxL) -> jax.Array:
    """(B,) float32: label 0's score at each row's last valid token."""
    return model.last_token_scores(ids_BxL, mask_BxL)[:, 0].astype(jnp.float32)


def _packed_scores(model: SequenceClassifier, ids_BxL, mask_BxL, response_len, config):
    """(B,) float32 label-0 scores at each row's last token, over packed buffers. Group ids
    are all 0: consecutive rows whose prompts are equal share one copy (the rollout's n
    samples of a prompt are contiguous)."""
    b = ids_BxL.shape[0]
    pl = packing_lib.plan(ids_BxL, mask_BxL, response_len, jnp.zeros(b, jnp.int32), config)

    def body(step_plan, k, acc):
        buf = packing_lib.buffer(step_plan, ids_BxL, k)
        segments = (buf["segment_ids"], buf["prefix_ids"])
        scores = model(buf["input_ids"], buf["valid"], buf["positions"], segments=segments)
        last = packing_lib.gather_last_token(step_plan, scores[..., 0], k)
        return acc + last.astype(jnp.float32)

    return packing_lib.over_buffers(pl, body, jnp.zeros(b, jnp.float32))


@functools.partial(jax.jit, static_argnames=("graphdef", "micro_batch_size", "packing"))
def score_responses(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompts_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    responses_BxR: jax.Array,
    response_mask_BxR: jax.Array,
    micro_batch_size: int | None = None,
    packing: packing_lib.PackingConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scores a batch of (prompt, response) pairs with a reward model.

    Args:
      graphdef, state: `nnx.split(reward_model)` of a `SequenceClassifier` (label 0 is used).
      prompts_BxP, prompt_mask_BxP: left-padded prompt ids and their 0/1 mask.
      responses_BxR, response_mask_BxR: right-padded response ids and their 0/1 mask.
      micro_batch_size: rows per forward pass (must divide B); None = the whole batch at once.
      packing: pack the pairs instead (`reward_model.model.use_remove_padding`); then
        `micro_batch_size` is not used.

    Returns:
      (`token_level_scores` B×R float32 with the score on each response's last valid token,
       `scores` (B,) float32 sequence scores).

    Raises:
      ValueError: `micro_batch_size` does not divide B.
    """
    ids_BxL = jnp.concatenate([prompts_BxP, responses_BxR], axis=1)
    # each mask cast before the concat (as `training.batch.make_batch`): a float-to-int convert
    # after it, fused into the reduction over the prompt slice, failed in XLA:GPU's Triton emitter
    masks = (prompt_mask_BxP.astype(jnp.int32), response_mask_BxR.astype(jnp.int32))
    mask_BxL = jnp.concatenate(masks, axis=1)
    b = ids_BxL.shape[0]
    mb = micro_batch_size or b
    if b % mb:
        raise ValueError(f"micro_batch_size {mb} does not divide the batch size {b}")
    model = nnx.merge(graphdef, state)
    if packing is not None:
        scores_B = _packed_scores(model, ids_BxL, mask_BxL, responses_BxR.shape[1], packing)
        return place_on_last_token(scores_B, response_mask_BxR), scores_B

    def one(args):
        return _sequence_scores(model, *args)

    split = lambda x: x.reshape(b // mb, mb, *x.shape[1:])
    scores_B = jax.lax.map(one, (split(ids_BxL), split(mask_BxL))).reshape(b)
    return place_on_last_token(scores_B, response_mask_BxR), scores_B


def score_with_model(model: SequenceClassifier, *batch, micro_batch_size=None):
    """`score_responses` for a model object (splits it first; convenient outside the trainer)."""
    graphdef, state = nnx.split(model)
    return score_responses(graphdef, state, *batch, micro_batch_size=micro_batch_size)
