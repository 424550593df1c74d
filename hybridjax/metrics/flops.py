"""FLOP counts for `perf/mfu/actor`, and the peak matmul throughput they are compared against.

Counting follows verl's `FlopsCounter` (`verl/utils/flops_counter.py`): a training step costs
6 FLOPs per parameter per token (forward 2, backward 4) plus attention's score and value
matmuls, 12 · Σ seqlen² · head_dim · heads · layers (6× the 2·seqlen²·d forward cost, over the
causal square as verl counts it). Parameters counted are those that do matmuls: every layer
weight and the LM head (a tied head is counted once, as the head; the embedding lookup is free).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hybridjax.models.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: layers plus the LM head (V·D)."""
    return config.num_params(include_embedding=False) + config.vocab_size * config.hidden_size


def training_flops(config: ModelConfig, seq_lens: np.ndarray) -> float:
    """FLOPs of one forward + backward pass over sequences of the given valid lengths.

    Args:
      config: the model.
      seq_lens: (B,) valid tokens (prompt + response) of each sequence.
    Returns: 6·N·Σlen + 12·Σlen²·head_dim·heads·layers, in FLOPs (float).
    """
    lens = np.asarray(seq_lens, dtype=np.float64)
    dense = 6.0 * matmul_params(config) * lens.sum()
    attn = (
        12.0
        * float((lens**2).sum())
        * config.resolved_head_dim
        * config.num_attention_heads
        * config.num_hidden_layers
    )
    return dense + attn


def measure_peak_flops(size: int = 1024, repeats: int = 3) -> float:
    """Measured float32 matmul FLOP/s per device: every device multiplies its own size² pair at
    once, best of `repeats`. On simulated CPU devices this is the machine's rate / device count."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    n = len(devices)
    x = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
    matmul = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
