"""The update phase as one pure function: epochs × mini-batches × micro-batches.

Shared by the actor and the critic. For each of `ppo_epochs` epochs the B rows are split into
mini-batches; each mini-batch into micro-batches whose gradients are summed (gradient
accumulation, `lax.scan`), then one optimizer step is taken. Loss functions return this
micro-batch's *share* of the mini-batch loss (sums over global counts, see
`hybridjax.algorithms.loss_agg`), so the summed gradient equals the full mini-batch gradient.

Splitting keeps every micro-batch spread over all data-parallel shards: rows are viewed as
(micro, K) with the sharded batch axis first, and micro-batch k is column k. No row crosses a
device to form a micro-batch.

With `UpdateConfig.packing` the micro-batches are the buffers of a packing plan of each
mini-batch instead (`hybridjax.models.packing`: no padding, shared prompts, a token budget per
buffer, their number data dependent): the loss sees the whole mini-batch with `response_mask`
and every float column zeroed outside the buffer at hand, and `fields` must also hold
`input_ids`, `attention_mask`, `responses` and `group_ids`. The sum over buffers is again the
mini-batch gradient.

Non-finite loss or gradient norm: the optimizer step is skipped (parameters and optimizer state
kept), and counted in `nan_steps`.

A loss may also return per-row arrays (e.g. the log-probs it computed); they come back for the
first epoch in the batch's row order, each row computed with the parameters before its
mini-batch's optimizer step (for an on-policy update: the parameters the phase started from).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hybridjax.algorithms.loss_agg import LossCounts, loss_counts
from hybridjax.models import packing
from hybridjax.models.lora import merge_trainable, split_trainable

# loss_fn(params, micro_batch: dict of B_micro×... arrays, counts)
#     -> (loss, (metrics: dict of scalar shares, rows: dict of B_micro×... arrays, may be empty))
Rows = dict[str, jax.Array]
LossFn = Callable[
    [Any, dict[str, jax.Array], LossCounts], tuple[jax.Array, tuple[dict[str, jax.Array], Rows]]
]


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Static shape of the update phase (all counts in responses, over all devices)."""

    ppo_epochs: int
    mini_batch_size: int  # ppo_mini_batch_size × rollout.n
    micro_batch_size: int  # ppo_micro_batch_size_per_gpu × data-parallel size
    shuffle: bool = False
    packing: packing.PackingConfig | None = None  # packed buffers instead of row micro-batches


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters (an `nnx.State`), optimizer state, and the number of updates done."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: training steps this role has been updated in


def _split(x: jax.Array, num_chunks: int) -> jax.Array:
    """B×... → num_chunks × (B/num_chunks)×...: row r goes to chunk r % num_chunks, so each chunk
    keeps the batch axis's sharding (see the module docstring)."""
    b = x.shape[0]
    y = x.reshape(b // num_chunks, num_chunks, *x.shape[1:])
    return jnp.moveaxis(y, 1, 0)


def _merge(y: jax.Array) -> jax.Array:
    """The inverse of `_split`: num_chunks × (B/num_chunks)×... → B×... in the original order."""
    return jnp.moveaxis(y, 0, 1).reshape(-1, *y.shape[2:])


def ppo_update(
    state: TrainState,
    fields: dict[str, jax.Array],
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    config: UpdateConfig,
    rng: jax.Array,
) -> tuple[TrainState, dict[str, jax.Array], Rows]:
    """Runs the whole update phase of one role. Jit it with `loss_fn`, `tx`, `config` static.

    Args:
      state: current parameters and optimizer state (learning rate already set).
      fields: the batch columns the loss reads, each with the B rows first; must hold
        `response_mask` (B×R) for the global counts.
      loss_fn: see `LossFn`; its metrics must be micro-batch shares (they are summed).
      tx: the optimizer.
      config: epochs and batch sizes; B must be a multiple of `mini_batch_size`, which must be a
        multiple of `micro_batch_size` (validated with the config at start).
      rng: permutation key when `config.shuffle`.
    Returns:
      (new state with `step` + 1, metrics averaged over mini-batches and epochs, plus
      `grad_norm` and `nan_steps`, the count of skipped optimizer steps; the loss's rows of
      the first epoch, B×... in the order of `fields`).
    """
    b = fields["response_mask"].shape[0]
    # LoRA: gradients and optimizer steps for the adapters only; the frozen base is closed over
    trainable, frozen = split_trainable(state.params)
    num_mini = b // config.mini_batch_size
    num_micro = config.mini_batch_size // config.micro_batch_size

    def micro_step(params, micro, counts):
        full_loss = lambda p, m, c: loss_fn(merge_trainable(p, frozen), m, c)
        grad_fn = jax.value_and_grad(full_loss, has_aux=True)
        (loss, (metrics, rows)), grads = grad_fn(params, micro, counts)
        return (grads, dict(metrics, loss=loss)), rows

    def micro_batches(params, mini, counts):
        micros = jax.tree.map(lambda x: _split(x, num_micro), mini)

        def accumulate(acc, micro):
            summed, rows = micro_step(params, micro, counts)
            return jax.tree.map(jnp.add, acc, summed), rows

        first = jax.tree.map(lambda x: x[0], micros)
        shapes, _ = jax.eval_shape(micro_step, params, first, counts)
        (grads, metrics), rows = jax.lax.scan(
            accumulate, jax.tree.map(jnp.zeros_like, shapes), micros
        )
        return grads, metrics, jax.tree.map(_merge, rows)

    def buffers(params, mini, counts):
        r = mini["responses"].shape[1]
        pl = packing.plan(
            mini["input_ids"], mini["attention_mask"], r, mini["group_ids"], config.packing
        )

        def micro(step_plan, k):
            here = packing.in_buffer(step_plan, k)
            keep = lambda x: x * here.reshape(-1, *(1,) * (x.ndim - 1)).astype(x.dtype)
            only = {
                n: keep(x) if jnp.issubdtype(x.dtype, jnp.floating) else x for n, x in mini.items()
            }
            return dict(only, pack_plan=step_plan, pack_buffer=k), keep

        def body(step_plan, k, acc):
            fields_k, keep = micro(step_plan, k)
            summed, rows = micro_step(params, fields_k, counts)
            return jax.tree.map(jnp.add, acc, (summed, jax.tree.map(keep, rows)))

        shapes = jax.eval_shape(lambda: micro_step(params, micro(pl, jnp.int32(0))[0], counts))
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (grads, metrics), rows = packing.over_buffers(pl, body, init)
        return grads, metrics, rows

    def mini_step(carry, mini):
        params, opt_state, nan_steps = carry
        counts = loss_counts(mini["response_mask"])
        accumulate = micro_batches if config.packing is None else buffers
        grads, metrics, rows = accumulate(params, mini, counts)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)

        def step(params, opt_state):
            updates, new_opt = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        # a branch, not a select of new and old: the old values are not read after the step,
        # so XLA updates parameters and optimizer state in place (no copy of either)
        params, opt_state = jax.lax.cond(finite, step, lambda p, o: (p, o), params, opt_state)
        metrics = dict(metrics, grad_norm=grad_norm)
        carry = (params, opt_state, nan_steps + (~finite).astype(jnp.int32))
        return carry, (metrics, rows)

    def epoch(carry, key):
        data = fields
        if config.shuffle:
            perm = jax.random.permutation(key, b)
            data = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), fields)
        minis = jax.tree.map(lambda x: _split(x, num_mini), data)
        carry, (metrics, rows) = jax.lax.scan(mini_step, carry, minis)
        rows = jax.tree.map(_merge, rows)
        if config.shuffle:  # back to the order of `fields`
            rows = jax.tree.map(lambda x: jnp.take(x, jnp.argsort(perm), axis=0), rows)
        return carry, (metrics, rows)

    keys = jax.random.split(rng, config.ppo_epochs)
    init = (trainable, state.opt_state, jnp.zeros((), jnp.int32))
    (params, opt_state, nan_steps), (metrics, rows) = jax.lax.scan(epoch, init, keys)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["nan_steps"] = nan_steps
    rows = jax.tree.map(lambda x: x[0], rows)
    params = merge_trainable(params, frozen)
    return TrainState(params, opt_state, state.step + 1), metrics, rows
