"""Token sampling with per-row parameters, and the log-probability of the sampled token.

Order (as vLLM and HF): temperature, then top-k, then top-p on the top-k-renormalised
distribution. The returned log-prob is that of the distribution actually sampled from:

  * no top-k/top-p: log_softmax(logits / T)[token], exactly what the trainer computes with the
    rollout temperature applied;
  * with top-k/top-p: log-prob under the truncated distribution renormalised over the kept
    tokens, i.e. the trainer's value minus log(kept probability mass) (>= the trainer's);
  * greedy rows (T = 0): log_softmax(logits)[argmax] (temperature 1), what a trainer with T = 1
    computes for the same token.

Sampling-mask replay: with each token `sample_tokens` also returns the support it was drawn
from as one number, a threshold τ in temperature-scaled logits with support exactly
{v : logits_v / T ≥ τ}, halfway between the smallest kept logit and the largest dropped one
(`support_threshold`); −inf where nothing was truncated (no filter, greedy rows, or
a filter that kept every token). The trainer rebuilds the support from it
(`hybridjax.models.logprobs`, `threshold_BxT`) and scores the truncated distribution the
token was drawn from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax.models import invariant

NEG_INF = -jnp.inf


def support_threshold(scaled_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """τ_B float32: the threshold of each row's top-k / top-p set (k <= 0 or p >= 1: off), so
    that the kept set is exactly {v : scaled_v ≥ τ} (ties at the smallest kept logit all
    kept); −inf where the set is the whole vocabulary.

    τ sits halfway between the smallest kept logit and the largest dropped one, not on the
    former: another computation of the same logits (the trainer's, in another order or
    precision) that moves each by less than half that gap finds the same set, where a
    threshold on the boundary token would drop it at its first rounding. Cost: a full sort
    of each row (B × V log V).
    """
    v = scaled_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)
    rank = jnp.arange(v)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    in_top_k = rank[None, :] < k_B[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_BxV, NEG_INF), axis=-1)
    mass_before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs
    keep = in_top_k & ((mass_before < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0))
    num_kept = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    kept_min = jnp.take_along_axis(sorted_BxV, (num_kept - 1)[:, None], axis=-1)
    dropped_max = jnp.max(jnp.where(sorted_BxV < kept_min, sorted_BxV, NEG_INF), axis=-1)
    kept_min = kept_min[:, 0]
    middle = kept_min / 2 + dropped_max / 2
    # adjacent floats: the middle rounds onto one of them; the boundary itself is then exact
    middle = jnp.where((middle > dropped_max) & (middle <= kept_min), middle, kept_min)
    return jnp.where(dropped_max > NEG_INF, middle, NEG_INF)


def truncate_logits(scaled_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k / top-p set (`support_threshold`) to -inf."""
    threshold_B = support_threshold(scaled_BxV, top_k_B, top_p_B)
    return jnp.where(scaled_BxV >= threshold_B[:, None], scaled_BxV, NEG_INF)


def first_argmax(x_BxV: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first index of the maximum) as two plain reductions:
    XLA's CPU argmax (a variadic reduce) is several times slower."""
    max_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    v = x_BxV.shape[-1]
    return jnp.min(jnp.where(x_BxV == max_Bx1, jnp.arange(v), v), axis=-1).astype(jnp.int32)


def step_uniforms(base_keys_Bx2: jax.Array, first_step_B: jax.Array, num_steps: int) -> jax.Array:
    """Uniform [0, 1) numbers B×num_steps: entry (b, i) is drawn with
    `fold_in(base_keys[b], first_step[b] + i)`, so a row's i-th generated token uses the same
    number whatever the batch and call boundaries (one PRNG evaluation per decode call, not
    per step)."""
    steps = jnp.arange(num_steps)

    def row(key, first):
        keys = jax.vmap(lambda i: jax.random.fold_in(key, first + i))(steps)
        return jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(keys)

    return jax.vmap(row)(base_keys_Bx2, first_step_B)


def inverse_cdf_sample(uniform_B: jax.Array, probs_BxV: jax.Array, block: int = 64) -> jax.Array:
    """One draw per row from `probs` with a single uniform: the first index whose cumulative
    probability exceeds u·total. A zero-probability token is never drawn.

    Two levels, so the work is one pass over B×V plus B×(V/block + block): the block whose
    cumulative mass passes the target, then the token inside it. One random number per row
    instead of V Gumbel draws (`jax.random.categorical`): on CPU, threefry for B×V numbers
    costs more than the step's matmuls on small models. float32 rounding of the cumulative sums
    perturbs probabilities by ~√V·1e-7.
    """
    b, v = probs_BxV.shape
    n = -(-v // block)
    padded_BxV = jnp.pad(probs_BxV, ((0, 0), (0, n * block - v)))
    blocks_BxNxS = padded_BxV.reshape(b, n, block)
    mass_BxN = jnp.sum(blocks_BxNxS, axis=-1)
    cdf_BxN = jnp.cumsum(mass_BxN, axis=-1)
    target_B = uniform_B * cdf_BxN[:, -1]
    # Rounding can put the target at or past the total: stay on the last block (token) with mass.
    last_block_B = jnp.max(jnp.where(mass_BxN > 0, jnp.arange(n), 0), axis=-1)
    block_B = jnp.minimum(jnp.sum(cdf_BxN <= target_B[:, None], axis=-1), last_block_B)
    probs_BxS = jnp.take_along_axis(blocks_BxNxS, block_B[:, None, None], axis=1)[:, 0]
    before_B = jnp.take_along_axis(cdf_BxN - mass_BxN, block_B[:, None], axis=1)[:, 0]
    cdf_BxS = before_B[:, None] + jnp.cumsum(probs_BxS, axis=-1)
    last_B = jnp.max(jnp.where(probs_BxS > 0, jnp.arange(block), 0), axis=-1)
    index_B = jnp.minimum(jnp.sum(cdf_BxS <= target_B[:, None], axis=-1), last_B)
    return (block_B * block + index_B).astype(jnp.int32)


def sample_tokens(
    logits_BxV: jax.Array,
    uniform_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
    use_filter: bool,
    batch_invariant: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row, its log-prob and the support's threshold (module docstring).

    Args:
      logits_BxV: float32 logits. uniform_B: float32 in [0, 1), one per row (`step_uniforms`).
      temperature_B: float32, 0 for greedy. top_k_B: int32. top_p_B: float32.
      use_filter: static; False skips top-k/top-p entirely (no sort).
      batch_invariant: static; the log-softmax per fixed tile of rows
        (`invariant.log_softmax`, parity mode), as the trainer computes it.
    Returns:
      tokens_B int32, log_probs_B float32, threshold_B float32 (τ in logits / T; −inf: the
      whole vocabulary).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temperature_B <= 0.0
    t_B = jnp.where(greedy_B, 1.0, temperature_B)
    scaled_BxV = logits_BxV / t_B[:, None]
    threshold_B = jnp.full(greedy_B.shape, NEG_INF, jnp.float32)
    if use_filter:
        # Greedy rows keep their full distribution (their log-prob is at T = 1, untruncated).
        top_k_B = jnp.where(greedy_B, -1, top_k_B)
        top_p_B = jnp.where(greedy_B, 1.0, top_p_B)
        threshold_B = support_threshold(scaled_BxV, top_k_B, top_p_B)
        scaled_BxV = jnp.where(scaled_BxV >= threshold_B[:, None], scaled_BxV, NEG_INF)
    if batch_invariant:
        log_probs_BxV = invariant.log_softmax(scaled_BxV)
    else:
        log_probs_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
    sampled_B = inverse_cdf_sample(uniform_B, jnp.exp(log_probs_BxV))
    tokens_B = jnp.where(greedy_B, first_argmax(logits_BxV), sampled_B).astype(jnp.int32)
    log_probs_B = jnp.take_along_axis(log_probs_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, log_probs_B, threshold_B
