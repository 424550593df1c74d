"""Trainer-side forward passes over (prompt + response): response log-probs, entropy, values.

The model reads `input_ids = prompts ++ responses` B×(P+R); the logit at position P−1+t predicts
response token t, so response quantities are positions [P−1, P+R−1). Log-probs apply the
sampler's temperature first (logits / T), as the rollout engine does, so old, rollout and
current log-probs are of the same distribution; the LM head runs fused with the log-softmax
(`hybridjax.models.logprobs`), so no pass holds B×R×V logits. Values follow verl's
critic: the value of response token t is the critic's output at position P−1+t (the state
before emitting it).

Sampling-mask replay: when `fields` holds `rollout_logit_threshold` (B×R, the support each
response token was sampled from; `hybridjax.rollout.sampling`), the log-probs and entropy are
those of the policy truncated to that support (`hybridjax.models.logprobs`); the stages put
it there for the policy's own passes only (old, current), never the reference's or teacher's.

Packed passes (`hybridjax.models.packing`): `fields` then also holds `pack_plan` and
`pack_buffer` (the buffer index k); the model reads buffer k and the outputs come back in the
B×R layout, 0 for rows outside buffer k. `packed_map` runs a pass over every buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybridjax.models import packing
from hybridjax.models.logprobs import FUSED, LogProbConfig, token_log_probs, top_k_log_probs


def response_log_probs(
    graphdef: nnx.GraphDef,
    params: Any,
    fields: dict[str, jax.Array],
    temperature: float,
    with_entropy: bool = False,
    head: LogProbConfig = FUSED,
) -> tuple[jax.Array, jax.Array | None]:
    """log π(response_t | prefix) and (optionally) the entropy at each response position:
    `model_log_probs` of the merged `CausalLM` (`nnx.split`'s graphdef and params)."""
    return model_log_probs(
        nnx.merge(graphdef, params), fields, temperature, with_entropy=with_entropy, head=head
    )


def model_log_probs(
    model: nnx.Module,
    fields: dict[str, jax.Array],
    temperature: float,
    with_entropy: bool = False,
    head: LogProbConfig = FUSED,
) -> tuple[jax.Array, jax.Array | None]:
    """log π(response_t | prefix) and (optionally) the entropy at each response position.

    Args:
      model: a `CausalLM` (or its LoRA wrapper). Takes the model rather than its split state so
        that `moe.with_router_stats` can record the routing of this very module.
      fields: `input_ids`, `attention_mask`, `position_ids` (B×(P+R)) and `responses` (B×R);
        optionally `routed_experts` (B×(P+R)×L×k int32: routing replay, see `Transformer`).
      temperature: the rollout temperature (a Python float; 0 is treated as 1 (greedy)).
      head: how the LM head, log-softmax and entropy run (`hybridjax.models.logprobs`; fused
        by default: no B×R×V array).
    Returns:
      (log_probs B×R float32, entropy B×R float32 or None). Values at padding are garbage;
      callers mask with `response_mask`.
    Raises:
      ValueError: `routed_experts` in a packed pass (replay needs the B×(P+R) layout).
    """
    log_probs, entropy, _ = model_log_probs_and_hidden(
        model, fields, temperature, with_entropy, head
    )
    return log_probs, entropy


def model_log_probs_and_hidden(
    model: nnx.Module,
    fields: dict[str, jax.Array],
    temperature: float,
    with_entropy: bool = False,
    head: LogProbConfig = FUSED,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """`model_log_probs`, plus the hidden states that predict each response token, B×R×D in
    the rows' layout (packed passes gather them from their slots; 0 outside the buffer), for
    head computations beyond the sampled token (`hybridjax.models.logprobs.log_probs_at`)."""
    temperature = temperature if temperature > 0 else 1.0
    hidden, targets, to_rows, threshold = _predicting_hidden(model, fields)
    log_probs, entropy = token_log_probs(
        model, hidden, targets, temperature, head, with_entropy, threshold
    )
    return to_rows(log_probs), None if entropy is None else to_rows(entropy), to_rows(hidden)


def model_top_k(
    model: nnx.Module,
    fields: dict[str, jax.Array],
    temperature: float,
    k: int,
    vocab_limit: int = 0,
    head: LogProbConfig = FUSED,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log π(response_t) B×R, the k most likely next tokens' log-probs B×R×k float32 and
    ids B×R×k int32) at each response position, from one forward; the top k are computed
    from the head chunk by chunk (`hybridjax.models.logprobs.top_k_log_probs`, ids below
    `vocab_limit`), on a packed buffer's own slots. Values at padding are garbage."""
    temperature = temperature if temperature > 0 else 1.0
    hidden, targets, to_rows, _ = _predicting_hidden(model, fields)
    log_probs, _ = token_log_probs(model, hidden, targets, temperature, head)
    top, ids = top_k_log_probs(model, hidden, k, temperature, vocab_limit, head.chunk_size)
    return to_rows(log_probs), to_rows(top), to_rows(ids)


def _predicting_hidden(model, fields) -> tuple[jax.Array, jax.Array, Callable, jax.Array | None]:
    """(hidden states, the tokens they predict, a map of per-token outputs to the B×R rows,
    each token's support threshold or None without `rollout_logit_threshold` in `fields`).

    Unpacked: the B×R response positions (the LM head runs on R positions, not P+R). Packed:
    the buffer's slots, each fed the hidden state that predicts its token (`source_index`: the
    prompt's last token for the first token of every response of a group); outputs go to the
    rows by `gather_response` (trailing axes kept, 0 outside the buffer)."""
    responses = fields["responses"]
    replay = fields.get("routed_experts")
    threshold = fields.get("rollout_logit_threshold")
    if "pack_plan" in fields:
        if replay is not None:
            raise ValueError("routing replay needs unpacked passes (model.use_remove_padding)")
        pl, k = fields["pack_plan"], fields["pack_buffer"]
        call = lambda i, p, v, s: model.model(i, p, v, segments=s)
        (hidden, _), buf = _packed_call(call, fields)
        src = packing.source_index(pl, k)
        hidden = jnp.take_along_axis(hidden, src[..., None], axis=1)
        r = responses.shape[1]
        if threshold is not None:  # laid out as the tokens: each slot's own threshold
            b, width = fields["input_ids"].shape
            prompt = jnp.full((b, width - r), -jnp.inf, jnp.float32)
            aligned = jnp.concatenate([prompt, threshold.astype(jnp.float32)], axis=1)
            threshold = packing.buffer(pl, aligned, k)["input_ids"]
        to_rows = lambda y: packing.gather_response(pl, y, k, r)
        return hidden, buf["input_ids"], to_rows, threshold
    ids, mask, positions = fields["input_ids"], fields["attention_mask"], fields["position_ids"]
    hidden_BxTxD, _ = model.model(ids, positions, mask, routed_experts_BxTxLxK=replay)
    return hidden_BxTxD[:, -responses.shape[1] - 1 : -1], responses, lambda y: y, threshold


def response_values(graphdef: nnx.GraphDef, params: Any, fields: dict[str, jax.Array]) -> jax.Array:
    """Critic values B×R float32 of a `SequenceClassifier` (num_labels 1), masked by
    `fields["response_mask"]`."""
    model = nnx.merge(graphdef, params)
    mask = fields["response_mask"]
    if "pack_plan" in fields:
        pl, k = fields["pack_plan"], fields["pack_buffer"]
        scores, _ = _packed_call(lambda i, p, v, s: model(i, v, p, segments=s), fields)
        before = jnp.take_along_axis(scores[..., 0], packing.source_index(pl, k), axis=1)
        return packing.gather_response(pl, before, k, mask.shape[1]) * mask
    scores = model(fields["input_ids"], fields["attention_mask"], fields["position_ids"])
    return scores[:, -mask.shape[1] - 1 : -1, 0] * mask


def _packed_call(fn, fields):
    """`fn(ids, positions, valid, segments)` on buffer `pack_buffer`; returns (out, buffer)."""
    buf = packing.buffer(fields["pack_plan"], fields["input_ids"], fields["pack_buffer"])
    segments = (buf["segment_ids"], buf["prefix_ids"])
    return fn(buf["input_ids"], buf["positions"], buf["valid"], segments), buf


def packed_map(
    fn: Callable[[dict[str, jax.Array]], Any],
    fields: dict[str, jax.Array],
    group_ids_B: jax.Array,
    config: packing.PackingConfig,
) -> Any:
    """Applies `fn` (B×R outputs, 0 outside the buffer) to every buffer of a packing plan of
    `fields` and sums: each row's outputs come from the one buffer that holds it. Peak
    activation memory is one buffer's (`config.capacity` tokens per device)."""
    r = fields["responses"].shape[1]
    pl = packing.plan(fields["input_ids"], fields["attention_mask"], r, group_ids_B, config)
    with_plan = lambda step_plan, k: dict(fields, pack_plan=step_plan, pack_buffer=k)
    shapes = jax.eval_shape(fn, with_plan(pl, jnp.zeros((), jnp.int32)))
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    body = lambda step_plan, k, acc: jax.tree.map(jnp.add, acc, fn(with_plan(step_plan, k)))
    return packing.over_buffers(pl, body, init)


def map_micro_batches(
    fn: Callable[[dict[str, jax.Array]], Any], fields: dict[str, jax.Array], micro_batch_size: int
) -> Any:
    """Applies `fn` to micro-batches of `micro_batch_size` rows (sequentially, `lax.map`) and
    reassembles B rows, so peak activation memory is one micro-batch's. Each micro-batch takes
    rows spread over every data shard (row r → micro-batch r % K), as in `trainer.update`."""
    b = fields["response_mask"].shape[0]
    k = max(b // micro_batch_size, 1)
    split = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(b // k, k, *x.shape[1:]), 1, 0), fields)
    out = jax.lax.map(fn, split)
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(b, *y.shape[2:]), out)
