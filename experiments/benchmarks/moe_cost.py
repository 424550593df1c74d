"""A small mixture-of-experts model against a dense model of the same active parameters, on 8
simulated CPU devices: update and decode time, and collective bytes from the compiled HLO.

Models (float32, vocab 512, hidden 128, 4 layers, 4/2 heads): `moe` — every layer 8 experts of
width 256, top-2 (Qwen3-MoE); `dense` — a Qwen3 MLP of width 512, the same parameters per token
(2 × 256). Both run on an 8-device mesh: `moe` on ("data", "expert") = (2, 4), experts over
`expert` (`hybridjax.models.moe`, all-gather + grouped matmul + reduce-scatter in `shard_map`);
`dense` on ("data",) = 8, weights replicated. Tokens split over all 8 devices in both.

update: one jitted forward + backward + SGD step of the token-mean −log π over 16 rows × 64
tokens; decode: one jitted step of 16 rows × 1 token against a 64-slot `DenseKVCache`.
Medians of `repeats` wall seconds after one warm-up call, and the per-device result bytes of
each collective of the compiled programs (`recording.collective_bytes`).

    python -m experiments.benchmarks.moe_cost [--repeats 5] [--out DIR]

Writes `DIR/moe_cost.json` (default `results/YYYYMMDD_HHMMSS/`). No goal on CPU: the numbers
show what expert parallelism costs in communication against a dense model's none.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time

from hybridjax.models.config import ModelConfig

ROWS, LENGTH = 16, 64
COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
)
MODELS = {
    "moe": (
        dict(
            COMMON,
            family="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
        ),
        ((2, 4), ("data", "expert")),
    ),
    "dense": (dict(COMMON, family="qwen3", intermediate_size=512), ((8,), ("data",))),
}


def _timed(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, repeats: int) -> dict:
    """Update and decode seconds and collective bytes of model `name` (see the docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from experiments.benchmarks.recording import collective_bytes
    from hybridjax.models import CausalLM, DenseKVCache
    from hybridjax.sharding.rules import ACTOR_GENERATE_RULES, state_shardings

    fields, (shape, axes) = MODELS[name]
    config = ModelConfig(**fields)
    mesh = Mesh(
        np.array(jax.devices()[:8]).reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes)
    )
    model = CausalLM(config, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    # every weight replicated but the experts, which go over `expert` where the mesh has it
    rules = tuple(
        (n, "expert" if n == "expert" and "expert" in axes else None)
        for n, _ in ACTOR_GENERATE_RULES
    )
    params = jax.device_put(params, state_shardings(params, mesh, rules))
    rows = NamedSharding(mesh, P(axes))
    rng = np.random.default_rng(0)
    ids = jax.device_put(jnp.asarray(rng.integers(0, 512, (ROWS, LENGTH)), jnp.int32), rows)
    mask = jax.device_put(jnp.ones((ROWS, LENGTH), jnp.int32), rows)

    def loss(params, ids, mask):
        logits = nnx.merge(graphdef, params)(ids, mask)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    @jax.jit
    def update(params, ids, mask):
        value, grads = jax.value_and_grad(loss)(params, ids, mask)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    @jax.jit
    def decode(params, ids, cache):
        positions = jnp.full(ids.shape, LENGTH // 2, jnp.int32)
        logits, cache = nnx.merge(graphdef, params).decode(
            ids, positions, jnp.ones_like(ids), cache
        )
        return logits, cache

    cache = DenseKVCache.create(config, ROWS, LENGTH)
    step_ids = ids[:, :1]
    out = {"num_params": config.num_params(), "active_params": config.num_params(active=True)}
    with jax.set_mesh(mesh):
        for stage, fn, args in (
            ("update", update, (params, ids, mask)),
            ("decode", decode, (params, step_ids, cache)),
        ):
            hlo = fn.lower(*args).compile().as_text()
            out[stage] = {
                "seconds": _timed(fn, args, repeats),
                "collective_bytes": collective_bytes(hlo),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "")
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    out_dir = args.out or pathlib.Path("results") / datetime.datetime.now().strftime(
        "%Y%m%d_%H%M%S"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: measure(name, args.repeats) for name in MODELS}
    summary = {"rows": ROWS, "length": LENGTH, "devices": 8, "models": results}
    (out_dir / "moe_cost.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
