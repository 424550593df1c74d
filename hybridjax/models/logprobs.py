"""Token log-probs and entropy from hidden states, without a B×T×V array (fused LM head).

    z_btv = (h_bt · W_v) / temperature,   lse_bt = log Σ_v exp z_btv
    log π(y_bt) = z_bty − lse_bt,          H_bt = lse_bt − Σ_v softmax(z_bt)_v · z_btv

The fused path runs the LM head, the log-softmax, the target's log-prob and the entropy chunk
by chunk over positions (`lax.map` forward, `lax.scan` backward) under a `jax.custom_vjp`: the
forward keeps only log π, H and lse per token (B×T each); the backward recomputes each chunk's
logits and forms its gradient from them,

    ∂ log π(y)/∂z_v = 1[v = y] − p_v,      ∂H/∂z_v = −p_v · (z_v − lse + H)

(p = softmax(z)), so at most one chunk's B×C×V logits exist at a time, forward or backward.
The chunks cut the position axis, never the batch axis, so batch-sharded hidden states keep
their sharding.

Vocab-parallel head (`LogProbConfig.mesh` set, the training mesh): the fused head runs under
`jax.shard_map` with the vocabulary split over the mesh's `tensor` and `fsdp` axes (the
training rules' `vocab` axes, as far as they divide V) and the rows over the other axes. Each
device holds its D × V/n slice of the head, one chunk's hidden states of its rows' group (an
all-gather of B×C×D activations over the vocabulary axes) and that chunk's logits of its
vocabulary slice; the log-sum-exp is a `pmax` and a `psum` over the vocabulary axes, the
target's logit a masked local pick and a `psum` (Megatron's vocab-parallel cross-entropy,
Shoeybi et al. 2019). The backward forms each device's head gradient from its own slice
(summed over the row axes once after the chunk loop: data parallelism) and `psum`s the
hidden states' gradient over the vocabulary axes, so no device gathers the head or reduces
a full-size head gradient. Without a mesh, GSPMD partitions the same jnp chunks as it
likes: for the FSDP-stored head (D over fsdp) it all-gathers the D × V/tp head and
all-reduces its D × V/tp gradient (`tests/models/test_vocab_parallel.py` reads both in the
HLO).

Sampling-mask replay (`threshold_BxT` given): each position's support is the tokens whose
scaled logit reaches the position's threshold τ (`hybridjax.rollout.sampling`: the top-k /
top-p set the rollout drew from), the target always included (a rounding difference between
engine and trainer never leaves it out), and log π, H and their gradients are those of the
distribution renormalised over it:

    lse_bt = log Σ_{v: z_v ≥ τ_bt} exp z_btv,   p̃_v = exp(z_v − lse) on the support, 0 off it,

    ∂ log π(y)/∂z_v = 1[v = y] − p̃_v,          ∂H/∂z_v = −p̃_v · (z_v − lse + H)

(the truncated policy's own gradient: tokens off the support get none). τ = −inf is the
whole vocabulary.

The unfused path (`use_fused_kernels` False) is the reference: full logits, `log_softmax`,
and the entropy of `hybridjax.algorithms.entropy` (chunked and/or rematerialised per verl's
`entropy_from_logits_with_chunking` / `entropy_checkpointing`, which apply only there, as in
verl's `dp_actor`). Source of the fused kernel: verl's `use_fused_kernels`
(`verl/utils/kernel/linear_cross_entropy.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridjax.algorithms.entropy import entropy_from_logits
from hybridjax.models import invariant
from hybridjax.models.decoder import default_positions

# Positions per chunk of the fused head: a chunk's logits are B_local × 256 × V/tp float32
# (8 rows × 256 × 152k = 1.2 GB before vocabulary sharding), computed twice (forward and
# backward recompute) instead of kept.
FUSED_CHUNK_SIZE = 256
# The mesh axes the vocabulary is split over, in the order of the training rules' `vocab`
# rule (`hybridjax.sharding.rules.ACTOR_TRAIN_RULES`): tensor-major.
VOCAB_AXES = ("tensor", "fsdp")


@dataclasses.dataclass(frozen=True)
class LogProbConfig:
    """How log-probs and entropy are computed (hashable; verl's key names).

    use_fused_kernels: `actor_rollout_ref.model.use_fused_kernels`: the chunked custom-VJP head
      (no B×T×V array); False computes full float32 logits.
    entropy_checkpointing: `actor.entropy_checkpointing` (unfused path): the entropy's
      backward recomputes the softmax instead of keeping it.
    entropy_from_logits_with_chunking: `actor.entropy_from_logits_with_chunking` (unfused
      path): the entropy walks chunks of positions instead of one piece.
    chunk_size: positions per chunk (≥ 1), both paths.
    mesh: the pass's training mesh: the fused head runs vocab-parallel over its `tensor` and
      `fsdp` axes (see the module docstring). None: one device, or GSPMD's partitioning.
    """

    use_fused_kernels: bool = True
    entropy_checkpointing: bool = True
    entropy_from_logits_with_chunking: bool = True
    chunk_size: int = FUSED_CHUNK_SIZE
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"LogProbConfig.chunk_size must be >= 1, got {self.chunk_size}")


FUSED = LogProbConfig()  # the default: fused head, chunks of FUSED_CHUNK_SIZE positions


def token_log_probs(
    model,
    hidden_BxTxD: jax.Array,
    targets_BxT: jax.Array,
    temperature: float = 1.0,
    config: LogProbConfig = FUSED,
    with_entropy: bool = False,
    threshold_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(log π(targets) B×T float32, entropy B×T float32 nats or None) from hidden states.

    Args:
      model: a `CausalLM` (or a wrapper with `head_weight()` and `logits()`).
      hidden_BxTxD: the backbone's output for the positions that predict `targets_BxT`.
      targets_BxT: int token ids in [0, V).
      temperature: logits are divided by it (a Python float > 0).
      threshold_BxT: float32 support thresholds τ in scaled logits (sampling-mask replay,
        see the module docstring; −inf: the whole vocabulary), or None: the whole vocabulary
        everywhere. No gradient flows to it.
    A model with `config.batch_invariant` (parity mode) takes the unfused path whatever
    `config` says (B×T×V float32 logits), its head and log-softmax per fixed tile of rows: the
    rollout engine's computation of the sampled token's log-prob (`sampling.sample_tokens`).
    Raises ValueError on a temperature ≤ 0 or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"token_log_probs: temperature must be > 0, got {temperature}")
    if hidden_BxTxD.shape[:2] != targets_BxT.shape:
        raise ValueError(
            f"token_log_probs: hidden {hidden_BxTxD.shape} and targets {targets_BxT.shape} "
            "differ in B×T"
        )
    masked = threshold_BxT is not None
    if threshold_BxT is None:
        threshold_BxT = jnp.zeros(targets_BxT.shape, jnp.float32)  # unused
    threshold_BxT = jax.lax.stop_gradient(threshold_BxT.astype(jnp.float32))
    parity = getattr(getattr(model, "config", None), "batch_invariant", False)
    if config.use_fused_kernels and not parity:
        weight, layout = model.head_weight()
        w = weight.astype(hidden_BxTxD.dtype)
        split = vocab_split(config.mesh, w.shape[0 if layout == "vd" else 1], targets_BxT.shape[0])
        options = (layout, 1.0 / temperature, config.chunk_size, with_entropy, split, masked)
        log_probs, entropy = _fused(*options, hidden_BxTxD, w, targets_BxT, threshold_BxT)
        return log_probs, entropy if with_entropy else None
    logits_BxTxV = model.logits(hidden_BxTxD) / jnp.float32(temperature)
    if masked:
        vocab = jnp.arange(logits_BxTxV.shape[-1])
        keep = (logits_BxTxV >= threshold_BxT[..., None]) | (vocab == targets_BxT[..., None])
        # a finite floor: exp underflows to 0 and 0 · floor stays 0 in the entropy
        logits_BxTxV = jnp.where(keep, logits_BxTxV, jnp.finfo(jnp.float32).min)
    if parity:  # the engine's `sampling.sample_tokens` formula, per fixed tile of rows
        log_probs = invariant.log_softmax(logits_BxTxV)
    else:
        log_probs = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    log_probs = jnp.take_along_axis(log_probs, targets_BxT[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return log_probs, None
    return log_probs, _unfused_entropy(logits_BxTxV, config)


def _unfused_entropy(logits_BxTxV: jax.Array, config: LogProbConfig) -> jax.Array:
    chunk = config.chunk_size if config.entropy_from_logits_with_chunking else None
    fn: Callable[..., jax.Array] = functools.partial(
        entropy_from_logits, chunk_size=chunk or logits_BxTxV.shape[1]
    )
    if config.entropy_checkpointing:
        fn = jax.checkpoint(fn)
    return fn(logits_BxTxV)


def _logits(h_BxCxD, w, layout: str, scale: float) -> jax.Array:
    spec = "bcd,vd->bcv" if layout == "vd" else "bcd,dv->bcv"
    return jnp.einsum(spec, h_BxCxD, w, preferred_element_type=jnp.float32) * scale


def _to_chunks(x, chunk: int):
    """B×T×… → n×B×C×… (T padded with zeros to n·C)."""
    b, t = x.shape[:2]
    n = -(-t // chunk)
    x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)


def _from_chunks(x_nxBxC, t: int):
    """n×B×C×… → B×T×…"""
    n, b, c = x_nxBxC.shape[:3]
    return jnp.moveaxis(x_nxBxC, 0, 1).reshape(b, n * c, *x_nxBxC.shape[3:])[:, :t]


def vocab_split(mesh: Mesh | None, vocab: int, rows: int) -> Split | None:
    """(mesh, vocabulary axes, row axes) of the vocab-parallel head, or None (no mesh, or no
    axis of `VOCAB_AXES` divides `vocab`). Of the mesh's axes of size > 1, the vocabulary
    takes the longest prefix of `VOCAB_AXES` whose product divides `vocab`, the rows the
    longest prefix of the other axes whose product divides `rows`; the devices along any
    remaining axis hold every row (and compute the same)."""
    if mesh is None:
        return None

    def prefix(axes: list[str], size: int) -> tuple[str, ...]:
        kept: list[str] = []
        for a in axes:
            if size % math.prod(mesh.shape[b] for b in (*kept, a)):
                break
            kept.append(a)
        return tuple(kept)

    split = [a for a in mesh.axis_names if mesh.shape[a] > 1]  # size-1 axes: no collective
    vocab_axes = prefix([a for a in VOCAB_AXES if a in split], vocab)
    if not vocab_axes:
        return None
    return mesh, vocab_axes, prefix([a for a in split if a not in vocab_axes], rows)


# (mesh, vocabulary axes, row axes) of the vocab-parallel head; see `vocab_split`
Split = tuple[Mesh, tuple[str, ...], tuple[str, ...]]


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _pmax(x, axes):
    return jax.lax.pmax(x, axes) if axes else x


def _first_id(w, layout, axes):
    """The first vocabulary id of this device's slice of the head (0 without axes)."""
    if not axes:
        return 0
    return jax.lax.axis_index(axes) * w.shape[0 if layout == "vd" else 1]


def _support(z, y_BxC, thr_BxC, first_id, masked: bool):
    """The scaled logits with the tokens off each position's support at −inf (`masked`),
    and the one-hot of the target (this device's vocabulary slice starts at `first_id`)."""
    onehot = (jnp.arange(z.shape[-1]) + first_id) == y_BxC[..., None]
    if not masked:
        return z, onehot
    return jnp.where((z >= thr_BxC[..., None]) | onehot, z, -jnp.inf), onehot


def _chunk_forward(layout, scale, with_entropy, masked, axes, w, h_BxCxD, y_BxC, thr_BxC):
    z = _logits(h_BxCxD, w, layout, scale)  # this device's vocabulary slice
    zs, _ = _support(z, y_BxC, thr_BxC, _first_id(w, layout, axes), masked)
    m = _pmax(jnp.max(zs, axis=-1), axes)
    lse = m + jnp.log(_psum(jnp.sum(jnp.exp(zs - m[..., None]), axis=-1), axes))
    local = y_BxC - _first_id(w, layout, axes)
    inside = (local >= 0) & (local < z.shape[-1])
    picked = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[..., None], axis=-1)
    log_prob = _psum(jnp.where(inside, picked[..., 0], 0.0), axes) - lse
    if not with_entropy:
        return log_prob, jnp.zeros_like(lse), lse
    entropy = lse - _psum(jnp.sum(jnp.exp(zs - lse[..., None]) * z, axis=-1), axes)
    return log_prob, entropy, lse


def _specs(layout, split: Split | None):
    """shard_map specs of (rows B×C, hidden B×C×D, head weight, the head gradient's stack
    R × head, one block per device along the row axes); all None without a split."""
    if split is None:
        return None, None, None, None
    _, vocab_axes, row_axes = split
    rows = row_axes or None
    weight = (vocab_axes, None) if layout == "vd" else (None, vocab_axes)
    return P(rows, None), P(rows, None, None), P(*weight), P(rows, *weight)


def _on_devices(fn, split: Split | None, in_specs, out_specs):
    """`fn(vocab_axes, row_axes, *blocks)` run by every device on its blocks (`shard_map`
    over the split's mesh, manual collectives), or `fn((), (), *arrays)` without a split."""
    if split is None:
        return functools.partial(fn, (), ())
    mesh, vocab_axes, row_axes = split
    return jax.shard_map(
        functools.partial(fn, vocab_axes, row_axes),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )


def _relaid(w, weight_spec, split: Split | None):
    """The head in the split's layout (vocabulary over its axes), relaid once before the
    chunk loop (XLA moves the shards with an all-to-all; `tests/models/test_vocab_parallel.py`
    checks that no gather of the head is left)."""
    if split is None:
        return w
    return jax.lax.with_sharding_constraint(w, NamedSharding(split[0], weight_spec))


def _fused_forward(layout, scale, chunk, with_entropy, split, masked, h_BxTxD, w, y_BxT, thr_BxT):
    t = y_BxT.shape[1]
    c = min(chunk, t)
    rows, hidden, weight, _ = _specs(layout, split)
    w = _relaid(w, weight, split)
    body = _on_devices(
        lambda axes, _, *xs: _chunk_forward(layout, scale, with_entropy, masked, axes, *xs),
        split,
        (weight, hidden, rows, rows),
        (rows, rows, rows),
    )
    chunks = (_to_chunks(h_BxTxD, c), _to_chunks(y_BxT, c), _to_chunks(thr_BxT, c))
    outs = jax.lax.map(lambda xs: body(w, *xs), chunks)
    log_prob, entropy, lse = (_from_chunks(o, t) for o in outs)
    return (log_prob, entropy), (h_BxTxD, w, y_BxT, thr_BxT, lse, entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _fused(layout, scale, chunk, with_entropy, split, masked, h_BxTxD, w, y_BxT, thr_BxT):
    options = (layout, scale, chunk, with_entropy, split, masked)
    return _fused_forward(*options, h_BxTxD, w, y_BxT, thr_BxT)[0]


def _chunk_backward(layout, scale, with_entropy, masked, axes, w, g_w_1xW, *chunk_xs):
    """(this device's head gradient block + the chunk's, ∂h of the chunk summed over the
    vocabulary axes)."""
    h, y, thr, lse, entropy, g_lp, g_h_ent = chunk_xs
    z = _logits(h, w, layout, scale)
    zs, onehot = _support(z, y, thr, _first_id(w, layout, axes), masked)
    p = jnp.exp(zs - lse[..., None])  # 0 off the support
    g_z = (onehot - p) * g_lp[..., None]
    if with_entropy:
        g_z = g_z - p * (z - (lse - entropy)[..., None]) * g_h_ent[..., None]
    g_z = (g_z * scale).astype(h.dtype)
    spec_h = "bcv,vd->bcd" if layout == "vd" else "bcv,dv->bcd"
    spec_w = "bcd,bcv->vd" if layout == "vd" else "bcd,bcv->dv"
    g_h = _psum(jnp.einsum(spec_h, g_z, w, preferred_element_type=jnp.float32), axes)
    g_w = jnp.einsum(spec_w, h, g_z, preferred_element_type=jnp.float32)
    return g_w_1xW + g_w[None], g_h.astype(h.dtype)


def _fused_backward(layout, scale, chunk, with_entropy, split, masked, residuals, cotangents):
    h_BxTxD, w, y_BxT, thr_BxT, lse_BxT, entropy_BxT = residuals
    t = y_BxT.shape[1]
    c = min(chunk, t)
    rows, hidden, weight, stack = _specs(layout, split)
    body = _on_devices(
        lambda axes, _, w, g_w, *xs: _chunk_backward(
            layout, scale, with_entropy, masked, axes, w, g_w, *xs
        ),
        split,
        (weight, stack, hidden, *(rows,) * 6),
        (stack, hidden),
    )
    # the head gradient, one block per device along the row axes (data parallelism), summed
    # once after the loop: an all-reduce of a vocabulary shard
    blocks = 1 if split is None else math.prod(split[0].shape[a] for a in split[2])
    g_w = jnp.zeros((blocks, *w.shape), jnp.float32)
    if split is not None:
        g_w = jax.lax.with_sharding_constraint(g_w, NamedSharding(split[0], stack))
    xs = (h_BxTxD, y_BxT, thr_BxT, lse_BxT, entropy_BxT, *cotangents)
    step = lambda g_w, chunk_xs: body(w, g_w, *chunk_xs)
    g_w, g_h = jax.lax.scan(step, g_w, tuple(_to_chunks(x, c) for x in xs))
    return _from_chunks(g_h, t), g_w.sum(axis=0).astype(w.dtype), None, None


_fused.defvjp(_fused_forward, _fused_backward)


def next_token_log_probs(
    model, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array, config: LogProbConfig = FUSED
) -> jax.Array:
    """log π(token t+1 | tokens ≤ t), B×(T−1) float32, of a padded batch (garbage at padding;
    callers mask), through `token_log_probs`: the offline trainers' (SFT, DPO) pass."""
    positions = default_positions(attention_mask_BxT)
    hidden_BxTxD, _ = model.model(input_ids_BxT, positions, attention_mask_BxT)
    return token_log_probs(model, hidden_BxTxD[:, :-1], input_ids_BxT[:, 1:], 1.0, config)[0]


def top_k_log_probs(
    model,
    hidden_BxTxD: jax.Array,
    k: int,
    temperature: float = 1.0,
    vocab_limit: int = 0,
    chunk_size: int = FUSED_CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens at each position and their log-probs, without a B×T×V array.

    log π(v) = z_v − lse (z = h · W / temperature, lse over the whole vocabulary); the top k
    are taken among the ids below `vocab_limit` (0: every id), so a teacher whose vocabulary is
    padded beyond the student's never names an id the student lacks (the padding still counts
    in lse). Runs chunk by chunk over positions (`lax.map`): at most one chunk's B×C×V logits
    exist at a time. Forward only (no gradient).

    Args:
      model: a `CausalLM` (with `head_weight()`).
      hidden_BxTxD: the backbone's output for the positions to score.
      k: tokens kept per position, 1 ≤ k ≤ V (or `vocab_limit`).
      temperature: logits are divided by it (> 0).
    Returns:
      (log-probs B×T×k float32, descending; token ids B×T×k int32).
    Raises:
      ValueError: k outside [1, V], or a temperature ≤ 0.
    """
    if temperature <= 0:
        raise ValueError(f"top_k_log_probs: temperature must be > 0, got {temperature}")
    weight, layout = model.head_weight()
    vocab = weight.shape[0 if layout == "vd" else 1]
    limit = min(vocab_limit or vocab, vocab)
    if not 1 <= k <= limit:
        raise ValueError(f"top_k_log_probs: k must be in [1, {limit}], got {k}")
    w = weight.astype(hidden_BxTxD.dtype)

    def chunk(h_BxCxD):
        log_p = jax.nn.log_softmax(_logits(h_BxCxD, w, layout, 1.0 / temperature), axis=-1)
        values, ids = jax.lax.top_k(log_p[..., :limit], k)
        return values, ids.astype(jnp.int32)

    t = hidden_BxTxD.shape[1]
    values, ids = jax.lax.map(chunk, _to_chunks(jax.lax.stop_gradient(hidden_BxTxD), chunk_size))
    return _from_chunks(values, t), _from_chunks(ids, t)


def log_probs_at(
    model,
    hidden_BxTxD: jax.Array,
    ids_BxTxK: jax.Array,
    targets_BxT: jax.Array,
    target_log_probs_BxT: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """log π(v) at the given ids, B×T×K float32, differentiable, without a B×T×V array.

    With z = h · W / temperature and the target y's log-prob log π(y) = z_y − lse (from
    `token_log_probs`, whose fused backward carries the softmax), lse = z_y − log π(y), so

        log π(v) = z_v − z_y + log π(y),

    which needs only the K + 1 head rows of each position (a B×T×(K+1)×D gather of W).
    `target_log_probs_BxT` must be `token_log_probs(model, hidden_BxTxD, targets_BxT,
    temperature)` of the same model and hidden states.
    """
    weight, layout = model.head_weight()
    w_vd = (weight if layout == "vd" else weight.T).astype(hidden_BxTxD.dtype)
    ids = jnp.concatenate([targets_BxT[..., None], ids_BxTxK], axis=-1)
    z = jnp.einsum(
        "btd,btkd->btk", hidden_BxTxD, w_vd[ids], preferred_element_type=jnp.float32
    ) / jnp.float32(temperature)
    return z[..., 1:] - z[..., :1] + target_log_probs_BxT[..., None].astype(jnp.float32)
