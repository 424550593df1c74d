"""Step `kernels`: time and memory of the attention kernels, each against its jnp reference,
on Qwen2.5-0.5B's heads (14 query heads, 2 KV heads, head dim 64), bfloat16.

* Paged decode, one query per sequence over B = 32 sequences of W pages of 16 tokens each,
  page-table widths W = 24, 48, 96 (contexts of 384 … 1536 tokens; 4 sequences of 4 and 8
  pages in a dry run): `paged_attention_jnp` (gather, then dense attention: the reference),
  `paged_attention_blocked` (the jnp online softmax over blocks of pages: CPU and TPU) and
  `paged_attention_kernel` (our Pallas Triton kernel, the GPU default; without a GPU it runs in
  Pallas' interpreter, which checks that the kernel's API is there, not its speed).
  Bandwidth: the K and V bytes of every sequence's pages over the time, against step `env`'s
  copy bandwidth.
* Training attention, causal, one sequence of T = 2048 and 8192 tokens (128 and 256 in a dry
  run), forward + backward of Σ out·w: `blocked` (`hybridjax.models.blocked_attention`, the
  GPU path of training), `cudnn` (`jax.nn.dot_product_attention(implementation="cudnn")`,
  GPU only: its masks cover a causal row, not our packed shared-prompt buffers) and `xla`
  (the same call with the dense XLA implementation, the reference). FLOPs: 2·B·H·T²·D for the
  causal forward, 3.5 × that with the backward (FlashAttention-2's count), against step
  `env`'s bf16 matmul peak.

Each kernel: median seconds of 5 calls after 2 warm-ups (2 calls in a dry run), XLA's scratch
(`memory_analysis().temp_size_in_bytes` of the compiled program) and max |Δ| of the outputs
against the reference. A kernel that cannot run here (no GPU, an import that JAX no longer
has) gets a row saying why; a wrong result fails the step after every row is measured.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from experiments.gpu.step import Context, main

H, K, D, PAGE = 14, 2, 64, 16
DECODE_ROWS, DRY_DECODE_ROWS = 32, 4
TOLERANCE = 5e-2  # bf16 outputs of softmax-weighted sums of unit normals


def timed(fn, args, repeats: int) -> tuple[float, int]:
    """(median seconds of `repeats` calls after 2 warm-ups, XLA scratch bytes) of jit(fn)."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    scratch = int(compiled.memory_analysis().temp_size_in_bytes)
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), scratch


def decode_inputs(rows: int, width: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(width), 3)
    pages = rows * width
    q = jax.random.normal(keys[0], (rows, 1, H, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (K, pages, PAGE, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (K, pages, PAGE, D), jnp.bfloat16)
    table = jax.random.permutation(keys[0], pages).reshape(rows, width).astype(jnp.int32)
    positions = jnp.full((rows, 1), width * PAGE - 1, jnp.int32)
    return q, k, v, table, positions


def decode_rows(ctx: Context, bandwidth: float, gpu: bool) -> list[list]:
    from hybridjax.rollout.decode_attention import paged_attention_blocked, paged_attention_jnp
    from hybridjax.rollout.paged_kernel import paged_attention_kernel

    widths, repeats = ((4, 8), 2) if ctx.dry_run else ((24, 48, 96), 5)
    sequences = DRY_DECODE_ROWS if ctx.dry_run else DECODE_ROWS
    # without a GPU the Pallas kernel runs in Pallas' interpreter: its API is what is checked
    pallas = functools.partial(paged_attention_kernel, interpret=not gpu)
    rows = []
    for width in widths:
        args = decode_inputs(sequences, width)
        moved = 2 * sequences * width * PAGE * K * D * 2  # K and V pages read, bf16
        reference = np.asarray(paged_attention_jnp(*args), np.float32)
        kernels = (("jnp", paged_attention_jnp), ("jnp blocked", paged_attention_blocked))
        for name, fn in (*kernels, ("pallas", pallas)):
            name += "" if gpu or name != "pallas" else " (interpreted)"
            try:
                seconds, scratch = timed(fn, args, repeats)
                diff = float(np.abs(np.asarray(fn(*args), np.float32) - reference).max())
            except Exception as err:  # one kernel's failure is a row, the others still run
                rows.append([width, name, f"failed: {type(err).__name__}: {str(err)[:120]}"])
                continue
            rows.append([width, name, "ok" if diff < TOLERANCE else "WRONG", seconds * 1e3,
                         moved / seconds / bandwidth, scratch / 2**20, diff])  # fmt: skip
    return rows


def train_inputs(t: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (1, t, H, D), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, t, K, D), jnp.bfloat16) for key in keys[1:3])
    w = jax.random.normal(keys[3], (1, t, H, D), jnp.float32)
    return q, k, v, w


def train_kernels() -> dict:
    """name → f(q, k, v) → B×T×H×D, causal."""
    import jax
    import jax.numpy as jnp

    from hybridjax.models.blocked_attention import blocked_attention

    def blocked(q, k, v):
        b, t = q.shape[:2]
        zeros = jnp.zeros((b, t), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = blocked_attention(q, k, v, zeros, zeros, positions, jnp.ones((b, t), bool))
        return out.transpose(0, 2, 1, 3, 4).reshape(q.shape)  # B×K×T×G×D → B×T×H×D

    def library(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl
        )

    return {"xla": library("xla"), "blocked": blocked, "cudnn": library("cudnn")}


def train_rows(ctx: Context, peak: float, gpu: bool) -> list[list]:
    import jax
    import jax.numpy as jnp

    lengths, repeats = ((128, 256), 2) if ctx.dry_run else ((2048, 8192), 5)
    rows = []
    for t in lengths:
        q, k, v, w = train_inputs(t)
        flops = 3.5 * 2 * H * t * t * D
        reference = None
        for name, attend in train_kernels().items():
            if name == "cudnn" and not gpu:
                rows.append([t, name, "skipped: cuDNN attention needs a GPU"])
                continue
            loss = lambda q, k, v, attend=attend: jnp.sum(attend(q, k, v).astype(jnp.float32) * w)
            step = jax.value_and_grad(loss, argnums=(0, 1, 2))
            try:
                seconds, scratch = timed(step, (q, k, v), repeats)
                out = np.asarray(jax.jit(attend)(q, k, v), np.float32)
            except Exception as err:  # one kernel's failure is a row, the others still run
                rows.append([t, name, f"failed: {type(err).__name__}: {str(err)[:120]}"])
                continue
            reference = out if reference is None else reference
            diff = float(np.abs(out - reference).max())
            rows.append([t, name, "ok" if diff < TOLERANCE else "WRONG", seconds * 1e3,
                         flops / seconds / peak, scratch / 2**20, diff])  # fmt: skip
    return rows


def run(ctx: Context) -> None:
    import jax

    from experiments.gpu.env import measure_ceilings

    ceilings = ctx.earlier("env").get("ceilings") or measure_ceilings(ctx.dry_run)
    gpu = jax.default_backend() == "gpu"
    ctx.save(ceilings=ceilings)
    cols = ["pages", "kernel", "status", "ms", "of copy BW", "scratch MiB", "max |Δ| vs jnp"]
    decode = decode_rows(ctx, ceilings["copy_bytes_per_s"], gpu)
    sequences = DRY_DECODE_ROWS if ctx.dry_run else DECODE_ROWS
    title = f"paged decode, {sequences} sequences × pages of {PAGE} tokens"
    ctx.table(title, cols, decode)
    cols = ["tokens", "kernel", "status", "fwd+bwd ms", "of bf16 peak", "scratch MiB",
            "max |Δ| vs xla"]  # fmt: skip
    train = train_rows(ctx, ceilings["bf16_matmul_flops"], gpu)
    ctx.table("training attention, causal, forward + backward", cols, train)
    bad = [
        f"{r[1]} at {r[0]}: {r[2]}"
        for r in decode + train
        if not r[2].startswith(("ok", "skipped"))
    ]
    if bad:
        raise RuntimeError("; ".join(bad)[:300])


if __name__ == "__main__":
    main("kernels", run)
