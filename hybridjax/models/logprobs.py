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
their sharding; the logits of a chunk are sharded over the vocabulary like the head, and the
log-sum-exp is a cross-device max and sum (Megatron's vocab-parallel cross-entropy,
Shoeybi et al. 2019) wherever the partitioner leaves the vocabulary split.

The unfused path (`use_fused_kernels` False) is the reference: full logits, `log_softmax`,
and the entropy of `hybridjax.algorithms.entropy` (chunked and/or rematerialised per verl's
`entropy_from_logits_with_chunking` / `entropy_checkpointing`, which apply only there, as in
verl's `dp_actor`). Source of the fused kernel: verl's `use_fused_kernels`
(`verl/utils/kernel/linear_cross_entropy.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjax.algorithms.entropy import entropy_from_logits
from hybridjax.models.decoder import default_positions

# Positions per chunk of the fused head: a chunk's logits are B_local × 256 × V/tp float32
# (8 rows × 256 × 152k = 1.2 GB before vocabulary sharding), computed twice (forward and
# backward recompute) instead of kept.
FUSED_CHUNK_SIZE = 256


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
    """

    use_fused_kernels: bool = True
    entropy_checkpointing: bool = True
    entropy_from_logits_with_chunking: bool = True
    chunk_size: int = FUSED_CHUNK_SIZE

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
) -> tuple[jax.Array, jax.Array | None]:
    """(log π(targets) B×T float32, entropy B×T float32 nats or None) from hidden states.

    Args:
      model: a `CausalLM` (or a wrapper with `head_weight()` and `logits()`).
      hidden_BxTxD: the backbone's output for the positions that predict `targets_BxT`.
      targets_BxT: int token ids in [0, V).
      temperature: logits are divided by it (a Python float > 0).
    Raises ValueError on a temperature ≤ 0 or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"token_log_probs: temperature must be > 0, got {temperature}")
    if hidden_BxTxD.shape[:2] != targets_BxT.shape:
        raise ValueError(
            f"token_log_probs: hidden {hidden_BxTxD.shape} and targets {targets_BxT.shape} "
            "differ in B×T"
        )
    if config.use_fused_kernels:
        weight, layout = model.head_weight()
        w = weight.astype(hidden_BxTxD.dtype)
        options = (layout, 1.0 / temperature, config.chunk_size, with_entropy)
        log_probs, entropy = _fused(*options, hidden_BxTxD, w, targets_BxT)
        return log_probs, entropy if with_entropy else None
    logits_BxTxV = model.logits(hidden_BxTxD) / jnp.float32(temperature)
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


def _chunk_forward(layout, scale, with_entropy, w, h_BxCxD, y_BxC):
    z = _logits(h_BxCxD, w, layout, scale)
    lse = jax.nn.logsumexp(z, axis=-1)
    log_prob = jnp.take_along_axis(z, y_BxC[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return log_prob, jnp.zeros_like(lse), lse
    entropy = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
    return log_prob, entropy, lse


def _fused_forward(layout, scale, chunk, with_entropy, h_BxTxD, w, y_BxT):
    t = y_BxT.shape[1]
    c = min(chunk, t)
    body = lambda xs: _chunk_forward(layout, scale, with_entropy, w, *xs)
    outs = jax.lax.map(body, (_to_chunks(h_BxTxD, c), _to_chunks(y_BxT, c)))
    log_prob, entropy, lse = (_from_chunks(o, t) for o in outs)
    return (log_prob, entropy), (h_BxTxD, w, y_BxT, lse, entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(layout, scale, chunk, with_entropy, h_BxTxD, w, y_BxT):
    return _fused_forward(layout, scale, chunk, with_entropy, h_BxTxD, w, y_BxT)[0]


def _fused_backward(layout, scale, chunk, with_entropy, residuals, cotangents):
    h_BxTxD, w, y_BxT, lse_BxT, entropy_BxT = residuals
    g_log_prob, g_entropy = cotangents
    t = y_BxT.shape[1]
    c = min(chunk, t)
    xs = (h_BxTxD, y_BxT, lse_BxT, entropy_BxT, g_log_prob, g_entropy)

    def step(g_w, chunk_xs):
        h, y, lse, entropy, g_lp, g_h_ent = chunk_xs
        z = _logits(h, w, layout, scale)
        p = jnp.exp(z - lse[..., None])
        onehot = jnp.arange(z.shape[-1]) == y[..., None]
        g_z = (onehot - p) * g_lp[..., None]
        if with_entropy:
            g_z = g_z - p * (z - (lse - entropy)[..., None]) * g_h_ent[..., None]
        g_z = (g_z * scale).astype(h.dtype)
        spec_h = "bcv,vd->bcd" if layout == "vd" else "bcv,dv->bcd"
        spec_w = "bcd,bcv->vd" if layout == "vd" else "bcd,bcv->dv"
        g_h = jnp.einsum(spec_h, g_z, w, preferred_element_type=jnp.float32)
        g_w = g_w + jnp.einsum(spec_w, h, g_z, preferred_element_type=jnp.float32)
        return g_w, g_h.astype(h.dtype)

    chunks = tuple(_to_chunks(x, c) for x in xs)
    g_w, g_h = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), chunks)
    return _from_chunks(g_h, t), g_w.astype(w.dtype), None


_fused.defvjp(_fused_forward, _fused_backward)


def next_token_log_probs(
    model, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array, config: LogProbConfig = FUSED
) -> jax.Array:
    """log π(token t+1 | tokens ≤ t), B×(T−1) float32, of a padded batch (garbage at padding;
    callers mask), through `token_log_probs`: the offline trainers' (SFT, DPO) pass."""
    positions = default_positions(attention_mask_BxT)
    hidden_BxTxD, _ = model.model(input_ids_BxT, positions, attention_mask_BxT)
    return token_log_probs(model, hidden_BxTxD[:, :-1], input_ids_BxT[:, 1:], 1.0, config)[0]
