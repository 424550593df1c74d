"""The engine's device work as pure functions (the engine jits them, pools donated): prefill of
prompts into fresh pages, extension of running sequences by appended tokens (a tool's response
in a multi-turn rollout), and a decode loop over one batch of rows.

Neither knows about slots: a call runs on the rows it is given (the decode batch holds the
active slots only, see `hybridjax.rollout.slots`) and reads and writes the KV cache through
their page tables, so a sequence's cache does not depend on where it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from hybridjax.models.moe import with_router_stats
from hybridjax.rollout.paged_cache import PagedKVCache, Pools
from hybridjax.rollout.sampling import sample_tokens, step_uniforms
from hybridjax.rollout.slots import Slots

# The jnp decode loop's per-call copy of the rows' pages (`PagedKVCache.gathered`) is made only
# up to this size per device: beyond, each step gathers one block of pages at a time
# (`decode_attention.paged_attention_blocked`), scratch independent of the context length.
MAX_GATHERED_BYTES = 1 << 28


def _run(model: nnx.Module, method: str, record: bool, *args) -> tuple[Any, jax.Array]:
    """`getattr(model, method)(*args)` and, with `record`, the experts each token used in each
    MoE layer: N×T×L×k int32 (L = MoE layers in order; rollout routing replay, see
    `hybridjax.models.moe.with_router_stats`), else an empty N×T×0×0 array (`args[0]`: the
    N×T token ids)."""
    call = lambda m, *a: getattr(m, method)(*a)  # noqa: E731
    if not record:
        return call(model, *args), jnp.zeros((*args[0].shape[:2], 0, 0), jnp.int32)
    out, stats = with_router_stats(call)(model, *args)
    if stats is None:
        raise ValueError("recording the routing (rollout routing replay) needs a MoE model")
    return out, jnp.moveaxis(stats.expert_ids, 0, 2)


def prefill(
    graphdef: Any,
    state: Any,
    k_pools: Pools,
    v_pools: Pools,
    ids_NxT: jax.Array,
    mask_NxT: jax.Array,
    page_table_NxP: jax.Array,
    sliding_window: int | None,
    record_routing: bool = False,
) -> tuple[Pools, Pools, jax.Array]:
    """Runs N prompts (right-padded int32 ids, bool mask, positions from 0) through the model
    and writes their keys/values to the pages of `page_table_NxP` (masked tokens write
    nowhere). Returns the updated pools (per layer K×pages×page_size×D) and, with
    each token's experts N×T×L×k int32 with `record_routing` (`_run`; garbage on masked
    tokens), else N×T×0×0."""
    model = nnx.merge(graphdef, state)
    positions_NxT = jnp.broadcast_to(jnp.arange(ids_NxT.shape[1]), ids_NxT.shape)
    cache = PagedKVCache(
        k_pools, v_pools, page_table_NxP, "prefill", sliding_window=sliding_window,
        batch_invariant=model.config.batch_invariant,
    )  # fmt: skip
    (_, cache), routed = _run(
        model.model, "__call__", record_routing, ids_NxT, positions_NxT, mask_NxT, cache
    )
    return cache.k, cache.v, routed


def extend(
    graphdef: Any,
    state: Any,
    k_pools: Pools,
    v_pools: Pools,
    ids_NxT: jax.Array,
    start_N: jax.Array,
    mask_NxT: jax.Array,
    page_table_NxP: jax.Array,
    sliding_window: int | None,
    record_routing: bool = False,
) -> tuple[Pools, Pools, jax.Array]:
    """Appends tokens to N sequences whose keys/values are already in their pages: token t of
    row n sits at position start_N[n] + t, is written to the pages and attends to every earlier
    position of its sequence (the cached ones and the appended ones before it; the jnp paged
    attention, causal by position). Only the appended tokens are computed: the cached prefix
    is read, never recomputed. Masked tokens write nowhere. Returns the updated pools and the
    appended tokens' experts as `prefill` does."""
    model = nnx.merge(graphdef, state)
    positions_NxT = start_N[:, None] + jnp.arange(ids_NxT.shape[1])[None]
    cache = PagedKVCache(
        k_pools, v_pools, page_table_NxP, "decode", "jnp", sliding_window=sliding_window,
        batch_invariant=model.config.batch_invariant,
    )  # fmt: skip
    (_, cache), routed = _run(
        model.model, "__call__", record_routing, ids_NxT, positions_NxT, mask_NxT, cache
    )
    return cache.k, cache.v, routed


def decode_loop(
    graphdef: Any,
    state: Any,
    k_pools: Pools,
    v_pools: Pools,
    batch: Slots,
    exit_when_done: jax.Array,
    *,
    num_steps: int,
    use_filter: bool,
    impl: str,
    sliding_window: int | None,
    mesh: Mesh | None = None,
    constrain_pools: Callable[[Pools], Pools] = lambda pools: pools,
    routing_shape: tuple[int, int] | None = None,
):
    """Up to `num_steps` decode steps for the B rows of `batch` in one `lax.while_loop`.

    Each step feeds every active row its `token` at `position`, writes the key/value there,
    samples the next token (row i's k-th token draws `step_uniforms` number num_generated + k
    of its seed, so tokens do not depend on the batch a row runs in) and retires rows that
    emit a stop id or reach `max_tokens`. Inactive rows (finished or padding) run but write
    nothing. The loop stops after `num_steps`, when no row is active, or once
    `exit_when_done` rows finished.

    Attention reads the pools through `impl` (`decode_attention.decode_attention`, per device
    of `mesh`, the generation mesh): scratch of one block of pages, never a row's whole
    context; the jnp path gathers the rows' pages once per call instead while that copy is at
    most MAX_GATHERED_BYTES (faster on CPU, see `PagedKVCache.gathered`). `constrain_pools`
    keeps the pools' sharding inside the loop.

    `routing_shape` (L MoE layers, k experts per token) records the experts of each step's
    fed token (rollout routing replay, `_run`); None records nothing.

    Returns:
      (k_pools, v_pools, (token, position, active, num_generated) each B, steps run (int32),
      tokens B×K int32 (-1 where a row was inactive), log_probs B×K float32 (0 there),
      the sampled support's thresholds B×K float32 (`sampling.sample_tokens`; −inf there),
      experts B×K×L×k int32 of the token fed at each step (-1 where inactive; B×K×0×0 without
      `routing_shape`)).
    """
    b = batch.token.shape[0]
    base_keys = jax.vmap(
        lambda s: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s[0]), s[1]), s[2])
    )(batch.seed)
    # Active rows generate one token per step: step i draws token num_generated + i.
    uniform_BxK = step_uniforms(base_keys, batch.num_generated, num_steps)

    record = routing_shape is not None

    def cond(carry):
        i, _, _, _, active, _, _, _, _, _, done = carry
        return (i < num_steps) & jnp.any(active) & (done < exit_when_done)

    def body(carry):
        i, cache, token, position, active, n_gen, out_tok, out_lp, out_thr, out_ex, done = carry
        model = nnx.merge(graphdef, state)
        (logits, cache), routed = _run(
            model, "decode", record, token[:, None], position[:, None], active[:, None], cache
        )
        out_ex = out_ex.at[:, i].set(jnp.where(active[:, None, None], routed[:, 0], -1))
        sampling = (batch.temperature, batch.top_k, batch.top_p, use_filter, invariant)
        new_tok, lp, thr = sample_tokens(logits[:, 0], uniform_BxK[:, i], *sampling)
        out_tok = out_tok.at[:, i].set(jnp.where(active, new_tok, -1))
        out_lp = out_lp.at[:, i].set(jnp.where(active, lp, 0.0))
        out_thr = out_thr.at[:, i].set(jnp.where(active, thr, -jnp.inf))
        n_gen = n_gen + active
        stop = jnp.any(new_tok[:, None] == batch.stop_ids, axis=-1)
        finish = active & (stop | (n_gen >= batch.max_tokens))
        position = position + active
        token = jnp.where(active, new_tok, token)
        active = active & ~finish
        cache = dataclasses.replace(cache, k=constrain_pools(cache.k), v=constrain_pools(cache.v))
        done = done + finish.sum()
        out = (out_tok, out_lp, out_thr, out_ex)
        return (i + 1, cache, token, position, active, n_gen, *out, done)

    invariant = nnx.merge(graphdef, state).config.batch_invariant  # parity mode
    cache = PagedKVCache(
        k_pools, v_pools, batch.page_table, "decode", impl, sliding_window, mesh=mesh,
        batch_invariant=invariant,
    )  # fmt: skip
    if impl == "jnp" and not invariant and cache.gathered_bytes() <= MAX_GATHERED_BYTES:
        cache = cache.gathered()  # once per call; the steps keep the copy up to date
    out_tok = jnp.full((b, num_steps), -1, jnp.int32)
    out_lp = jnp.zeros((b, num_steps), jnp.float32)
    out_thr = jnp.full((b, num_steps), -jnp.inf, jnp.float32)
    out_ex = jnp.full((b, num_steps, *(routing_shape or (0, 0))), -1, jnp.int32)
    dynamic = (batch.token, batch.position, batch.active, batch.num_generated)
    carry = (0, cache, *dynamic, out_tok, out_lp, out_thr, out_ex, jnp.int32(0))
    steps, cache, token, position, active, n_gen, *out, _ = jax.lax.while_loop(cond, body, carry)
    out_tok, out_lp, out_thr, out_ex = out
    dynamic = (token, position, active, n_gen)
    return cache.k, cache.v, dynamic, steps, out_tok, out_lp, out_thr, out_ex
