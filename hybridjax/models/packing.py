"""Packed sequences: a padded batch laid end to end in fixed-size token buffers.

Every training-side pass (old/ref log-probs, values, the actor and critic updates, reward-model
scores, SFT) reads verl's padded layout: B rows of `prompts ++ responses`, prompts left padded
to P columns, responses right padded to R. Many of those B·(P+R) positions are padding, and
the n responses of a prompt carry n copies of it. A plan lays the valid tokens end to end:

    [prompt_a resp_a1 resp_a2 resp_a3 prompt_b resp_b1 … pad]        (one buffer, one device)

* Per data-parallel piece: the B rows are viewed as D pieces of m = B/D consecutive rows (the
  rows one device holds when the batch axis is sharded over D = data × expert × fsdp devices)
  and each piece fills its own row of every buffer, so buffers are D × capacity and no token
  crosses a device.
* Shared prompts: a piece's rows are sorted by group id (`group_ids`, e.g. uid or row // n);
  a row whose group and prompt tokens equal the previous row's reads that row's prompt copy
  instead of writing its own. A response attends to its group's prompt and causally to itself
  (segment ids + prefix segment ids, `models.attention.packed_attention_mask`), its positions
  continue from the prompt length, as in the padded row. The prompt's gradient accumulates
  once per copy, naturally. A group that does not fit the rest of a buffer opens the next one
  and writes its prompt again there: still exact, every response reads an identical copy.
* Buffers are filled next-fit in that order. Their number is data dependent (a device scalar,
  no host sync) and a pass loops over them (`over_buffers`, `lax.while_loop`s): shapes are
  static (one capacity per role; a step of `rows` buffer rows and a step of one for the rows
  left over), work follows the tokens present, and the token budget of a buffer is the
  micro-batch (verl's `use_dynamic_bsz`, `*_max_token_len_per_gpu`).
* Outputs come back in verl's B×R layout (`gather_response`, 0 outside the buffer at hand):
  the algorithms, losses and metrics of the padded path run unchanged. This is the one place
  that layout choice is made.

The logit that predicts response token t sits at the previous token of the same sequence:
the prompt's last token for t = 0 (one position for the whole group), response token t−1
otherwise (`source_index`).

Requirements (the rollout's layout): prompt tokens are the last p of the P prompt columns,
response tokens the first r of the R response columns, p ≥ 1, and P + R ≤ capacity.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

STEPS_PER_BUDGET = 4  # a micro-batch's token budget, split into this many loop steps


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How one role's pass is packed (static).

    row_length: tokens of one buffer row (≥ P + R); attention is dense within a row, so its
      cost per token grows with it, and a group shares one prompt only within a row
      (`row_responses` sizes it).
    rows: buffer rows per device per step: the token budget of a micro-batch is
      rows × row_length per device.
    pieces: data-parallel size D (data × expert × fsdp); B must be a multiple of it.
    share_prompts: rows of one group share one prompt copy (`use_prefix_sharing`).
    """

    row_length: int
    rows: int = 1
    pieces: int = 1
    share_prompts: bool = True

    @classmethod
    def for_budget(
        cls,
        token_budget: int,
        prompt_len: int,
        response_len: int,
        group_size: int,
        pair_cost: float = 0.0,
        **kw,
    ) -> PackingConfig:
        """Rows of P + k·R tokens (a prompt copy and k of its group's n responses), k chosen
        by `row_responses`; never shorter than P + R, never longer than the budget (P + R
        without sharing). Each loop step holds as many rows as a quarter of `token_budget`
        (tokens per device), at least one: the loop's count follows the tokens present, so
        an almost empty micro-batch costs one small step, not the whole budget.
        """
        seq = prompt_len + response_len
        row = seq
        if kw.get("share_prompts", True):
            k = row_responses(prompt_len, response_len, group_size, pair_cost, token_budget)
            row = max(min(prompt_len + k * response_len, token_budget), seq)
        return cls(row_length=row, rows=max(token_budget // row // STEPS_PER_BUDGET, 1), **kw)


def row_responses(
    prompt_len: int, response_len: int, group_size: int, pair_cost: float, token_budget: int
) -> int:
    """How many responses k (1 ≤ k ≤ n) a buffer row is sized for: the k of least estimated
    cost for a group at full lengths, ⌈n/k⌉ rows of L = P + k·R tokens, each costing
    L + `pair_cost`·L² token-equivalents (every token's matmuls, plus attention, which is dense
    within a row: L² query-key pairs). Few long responses per row on small models with long
    responses (attention dominates), a whole group per row otherwise (one prompt copy).
    Rows longer than `token_budget` are not considered (k = 1 always is). Ties: smaller k.

    `pair_cost` is one query-key pair's work in units of one token's
    (`trainer.packing.attention_pair_cost`: 2·head_dim·heads·layers / matmul parameters,
    ≈ 1/(6·hidden) for a standard decoder); 0 → a whole group per row when it fits.
    """

    def cost(k: int) -> float:
        length = prompt_len + k * response_len
        return -(-group_size // k) * (length + pair_cost * length**2)

    fits = [k for k in range(1, group_size + 1) if prompt_len + k * response_len <= token_budget]
    return min(fits or [1], key=cost)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each row's tokens go; every array D×m int32 unless noted (see module docstring)."""

    buffer: jax.Array  # buffer index of the row
    prompt_start: jax.Array  # offset of the prompt copy the row reads
    response_start: jax.Array  # offset of its first response token
    writes_prompt: jax.Array  # bool: the row writes that prompt copy
    prompt_len: jax.Array
    response_len: jax.Array
    num_buffers: jax.Array  # int32 scalar: buffer rows of the fullest piece
    capacity: int = dataclasses.field(metadata=dict(static=True))  # row length
    prompt_columns: int = dataclasses.field(metadata=dict(static=True))  # P
    rows: int = dataclasses.field(metadata=dict(static=True))  # buffer rows per step


def _pieces(x: jax.Array, d: int) -> jax.Array:
    return x.reshape(d, x.shape[0] // d, *x.shape[1:])


def _plan_piece(p, r, key, prompts, capacity):
    order = jnp.argsort(key, stable=True)
    p_s, r_s, k_s, pr_s = p[order], r[order], key[order], prompts[order]
    same = (k_s[1:] == k_s[:-1]) & (p_s[1:] == p_s[:-1]) & jnp.all(pr_s[1:] == pr_s[:-1], -1)
    shares = jnp.concatenate([jnp.zeros(1, bool), same])

    def step(carry, x):
        buf, fill, prompt_start = carry
        p_i, r_i, share = x
        new = fill + jnp.where(share, r_i, p_i + r_i) > capacity
        buf = buf + new.astype(jnp.int32)
        fill = jnp.where(new, 0, fill)
        writes = ~share | new
        prompt_start = jnp.where(writes, fill, prompt_start)
        response_start = jnp.where(writes, fill + p_i, fill)
        carry = (buf, response_start + r_i, prompt_start)
        return carry, (buf, prompt_start, response_start, writes)

    zero = jnp.zeros((), jnp.int32)
    _, out = jax.lax.scan(step, (zero, zero, zero), (p_s, r_s, shares))
    inverse = jnp.argsort(order)
    return tuple(o[inverse] for o in out)


def plan(
    input_ids_BxL: jax.Array,
    attention_mask_BxL: jax.Array,
    response_length: int,
    group_ids_B: jax.Array,
    config: PackingConfig,
) -> PackPlan:
    """Plans the packing of B padded rows (`prompts ++ responses`, L = P + R columns).

    Args:
      input_ids_BxL, attention_mask_BxL: int32 ids and 0/1 mask of the padded batch.
      response_length: R (static).
      group_ids_B: int32 group of each row (rows of a group share their prompt when
        `config.share_prompts` and their prompt tokens are equal; unequal group sizes are fine).
      config: capacity, pieces, sharing.
    Returns:
      The `PackPlan` (device arrays; `num_buffers` is not read on the host).
    Raises:
      ValueError: L > capacity, or B not a multiple of `config.pieces`.
    """
    b, length = input_ids_BxL.shape
    if length > config.row_length:
        raise ValueError(f"a row of {length} tokens does not fit a buffer of {config.row_length}")
    if b % config.pieces:
        raise ValueError(f"{b} rows do not split into {config.pieces} data-parallel pieces")
    p_cols = length - response_length
    mask = attention_mask_BxL.astype(jnp.int32)
    p = jnp.sum(mask[:, :p_cols], axis=1)
    r = jnp.sum(mask[:, p_cols:], axis=1)
    key = group_ids_B.astype(jnp.int32) if config.share_prompts else jnp.arange(b)
    d = config.pieces
    prompts = jnp.where(mask[:, :p_cols] > 0, input_ids_BxL[:, :p_cols], -1)
    args = [_pieces(x, d) for x in (p, r, key, prompts)]
    buf, prompt_start, response_start, writes = jax.vmap(
        functools.partial(_plan_piece, capacity=config.row_length)
    )(*args)
    return PackPlan(
        buffer=buf,
        prompt_start=prompt_start,
        response_start=response_start,
        writes_prompt=writes,
        prompt_len=args[0],
        response_len=args[1],
        num_buffers=jnp.max(buf) + 1,
        capacity=config.row_length,
        prompt_columns=p_cols,
        rows=config.rows,
    )


def _buffer_piece(pl: PackPlan, ids_mxL, k):
    c, p_cols = pl.capacity, pl.prompt_columns
    j = jnp.arange(ids_mxL.shape[1])[None, :]
    here = (pl.buffer == k)[:, None]
    p, r = pl.prompt_len[:, None], pl.response_len[:, None]
    lead = p_cols - p  # first valid prompt column
    t = j - p_cols  # response column
    in_prompt = (j < p_cols) & (j >= lead) & pl.writes_prompt[:, None] & here
    in_response = (j >= p_cols) & (t < r) & here
    dest = jnp.where(in_prompt, pl.prompt_start[:, None] + j - lead, c)
    dest = jnp.where(in_response, pl.response_start[:, None] + t, dest).reshape(-1)
    positions = jnp.where(j < p_cols, j - lead, p + t)
    segment = jnp.where(j < p_cols, pl.prompt_start[:, None], pl.response_start[:, None] + c)
    prefix = jnp.broadcast_to(pl.prompt_start[:, None], ids_mxL.shape)

    def put(values, fill):
        base = jnp.full((c,), fill, values.dtype)
        return base.at[dest].set(values.reshape(-1), mode="drop")

    return {
        "input_ids": put(ids_mxL, 0),
        "positions": put(positions, 0),
        "valid": put(jnp.ones(ids_mxL.shape, bool), False),
        "segment_ids": put(segment, -1),
        "prefix_ids": put(prefix, -2),
    }


def _step_rows(pl: PackPlan, k: jax.Array) -> jax.Array:
    return k * pl.rows + jnp.arange(pl.rows)


def buffer(pl: PackPlan, input_ids_BxL: jax.Array, k: jax.Array) -> dict[str, jax.Array]:
    """Step `k` of the plan (buffer rows k·rows … k·rows + rows − 1 of every piece):
    `input_ids`, `positions` (int32), `valid` (bool), `segment_ids`, `prefix_ids` (int32),
    each (D·rows)×row_length, piece-major. Empty slots are invalid."""
    d = pl.buffer.shape[0]
    per_row = jax.vmap(_buffer_piece, in_axes=(None, None, 0))  # over the step's rows
    out = jax.vmap(per_row, in_axes=(0, 0, None))(
        _vmap_plan(pl), _pieces(input_ids_BxL, d), _step_rows(pl, k)
    )
    return jax.tree.map(lambda x: x.reshape(d * pl.rows, pl.capacity), out)


def _vmap_plan(pl: PackPlan) -> PackPlan:
    """The plan with `num_buffers` broadcast to D, so `jax.vmap` maps every leaf over pieces."""
    d = pl.buffer.shape[0]
    return dataclasses.replace(pl, num_buffers=jnp.broadcast_to(pl.num_buffers, (d,)))


def source_index(pl: PackPlan, k: jax.Array) -> jax.Array:
    """(D·rows)×row_length int32: for each slot q of step `k`, the slot of the same buffer row
    whose hidden state predicts the token at q (q − 1, or the prompt's last token for a first
    response token)."""

    def one(p: PackPlan, row):
        c = p.capacity
        src = jnp.maximum(jnp.arange(c) - 1, 0)
        first = (p.buffer == row) & (p.response_len > 0)
        last_prompt = jnp.maximum(p.prompt_start + p.prompt_len - 1, 0)  # none: unused slot
        return src.at[jnp.where(first, p.response_start, c)].set(last_prompt, mode="drop")

    per_row = jax.vmap(one, in_axes=(None, 0))
    out = jax.vmap(per_row, in_axes=(0, None))(_vmap_plan(pl), _step_rows(pl, k))
    return out.reshape(-1, pl.capacity)


def _slot(pl: PackPlan, k: jax.Array, offset: jax.Array) -> jax.Array:
    """Index into a piece's flattened rows × row_length slots of step k (clipped)."""
    j = jnp.clip(pl.buffer - k * pl.rows, 0, pl.rows - 1)
    return j[..., None] * pl.capacity + jnp.minimum(offset, pl.capacity - 1)


def gather_response(pl: PackPlan, y: jax.Array, k: jax.Array, response_length: int):
    """B×R: `y` ((D·rows)×row_length×…, one step's outputs) at the slot of each response
    token of the rows packed in step `k`, 0 elsewhere (other steps, padding). Trailing axes
    of `y` are kept."""
    d = pl.buffer.shape[0]
    y = y.reshape(d, pl.rows * pl.capacity, *y.shape[2:])
    t = jnp.arange(response_length)
    ok = in_buffer(pl, k).reshape(d, -1)[..., None] & (t < pl.response_len[..., None])
    slot = _slot(pl, k, pl.response_start[..., None] + t)  # D×m×R
    values = jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(y, slot)
    ok = ok.reshape(ok.shape + (1,) * (values.ndim - 3))
    out = jnp.where(ok, values, 0)
    return out.reshape(-1, *out.shape[2:])


def gather_last_token(pl: PackPlan, y: jax.Array, k: jax.Array) -> jax.Array:
    """B(…): `y` of step `k` at each row's last token (last response token, else the prompt's
    last), 0 for rows of other steps."""
    d = pl.buffer.shape[0]
    y = y.reshape(d, pl.rows * pl.capacity, *y.shape[2:])
    r = pl.response_len
    last = jnp.where(r > 0, pl.response_start + r - 1, pl.prompt_start + pl.prompt_len - 1)
    values = jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(y, _slot(pl, k, last[..., None]))
    values = values[:, :, 0]
    ok = in_buffer(pl, k).reshape(d, -1)
    out = jnp.where(ok.reshape(ok.shape + (1,) * (values.ndim - 2)), values, 0)
    return out.reshape(-1, *out.shape[2:])


def in_buffer(pl: PackPlan, k: jax.Array) -> jax.Array:
    """B bool: the rows packed into step `k`."""
    return ((pl.buffer >= k * pl.rows) & (pl.buffer < (k + 1) * pl.rows)).reshape(-1)


def over_buffers(pl: PackPlan, body: Callable[[PackPlan, jax.Array, Any], Any], init: Any) -> Any:
    """`carry = body(step_plan, k, carry)` over every buffer row of the plan, no row twice:
    steps of `pl.rows` rows (`step_plan` = `pl`, k = 0 … ⌊num_buffers / rows⌋ − 1), then the
    rows left over one at a time (`step_plan` = `pl` with `rows` = 1, k = the row's index), so
    the last step never computes empty rows. Each is a `lax.while_loop` (the counts are data
    dependent, each iteration one micro-batch's work); with `rows` > 1 `body` is compiled for
    both step shapes. Returns the final carry."""

    def loop(step_plan: PackPlan, start: jax.Array, stop: jax.Array, carry: Any) -> Any:
        def step(state):
            k, c = state
            return k + 1, body(step_plan, k, c)

        return jax.lax.while_loop(lambda s: s[0] < stop, step, (start, carry))[1]

    full = pl.num_buffers // pl.rows
    carry = loop(pl, jnp.zeros((), jnp.int32), full, init)
    if pl.rows == 1:
        return carry
    return loop(dataclasses.replace(pl, rows=1), full * pl.rows, pl.num_buffers, carry)
