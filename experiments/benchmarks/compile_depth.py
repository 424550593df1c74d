"""Compile time against depth, with and without scanned decoder layers (`scan_layers`).

    python -m experiments.benchmarks.compile_depth [--layers 4,8,16,28] [--repeats 2] [--out DIR]

For each depth and `scan_layers` off / on (on: the layers' parameters stored stacked and run
as one scan, `hybridjax.models.decoder`), a random Qwen2-shaped actor of a fixed small width
(hidden 64, MLP 128, 4/2 heads, vocab 256, float32, layers checkpointed with the "full" policy)
on one CPU device:
  * `update_actor`: `hybridjax.training.passes.update_actor` jitted as `hybridjax.rl.step` does
    (graphdef and stage config static, the train state donated), lowered and compiled for a
    batch of 4 rows × (8 prompt + 8 response) tokens, 2 micro-batches: seconds of
    `.lower(...)` + `.compile()`;
  * decode: the paged engine's first `generate` call (4 decode steps, 2 slots): the seconds
    JAX reports for tracing, lowering to MLIR and the XLA compile of that call
    (`jax.monitoring` events), which is the engine's decode program (its paged cache keeps one
    pool per layer, so a scanned model decodes there layer by layer);
  * dense decode: 4 greedy decode steps of `CausalLM.decode` on a `DenseKVCache` (stacked for
    a scanned model: one scan over the layers with the cache in the carry) as one jitted
    `lax.scan`, lowered and compiled for 2 rows of 16 slots: seconds of `.lower` + `.compile`.
After one discarded warm-up round at depth 1, each is the median of `--repeats` fresh
compiles (`jax.clear_caches()` between; the persistent compilation cache is off). Writes
`DIR/compile_depth.json` (default `experiments/results/compile_depth/`) with the table and
the 28/4 (last/first) ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridjax.config.schema import base_config
from hybridjax.models.attention import DenseKVCache
from hybridjax.models.config import ModelConfig
from hybridjax.models.decoder import CausalLM
from hybridjax.rollout import Engine, RolloutConfig, SamplingParams
from hybridjax.rollout.pages import Request
from hybridjax.training import build, passes
from hybridjax.training.batch import make_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
WIDTH = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=True, remat=True,
)  # fmt: skip
COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
}
_seconds = {"total": 0.0}


def _on_event(event: str, duration_secs: float, **_) -> None:
    if event in COMPILE_EVENTS:
        _seconds["total"] += duration_secs


@contextlib.contextmanager
def _fresh():
    jax.clear_caches()
    yield
    jax.clear_caches()


def _stage_config():
    c = base_config()
    c.data.train_batch_size = 4
    c.data.max_prompt_length = 8
    c.data.max_response_length = 8
    c.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    c.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 2
    c.actor_rollout_ref.rollout.response_length = 8
    return build.stage_config(c, total_steps=2, data_parallel=1)


def update_compile_s(config: ModelConfig) -> float:
    """Seconds to lower and compile the trainer's jitted `update_actor` for `config`."""
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    cfg = _stage_config()
    state = build.init_train_state(params, cfg.actor_optim)
    rng = np.random.default_rng(0)
    mask = jnp.ones((4, 8), jnp.float32)
    batch = make_batch(
        jnp.asarray(rng.integers(1, 200, (4, 8))),
        jnp.ones((4, 8), jnp.int32),
        jnp.asarray(rng.integers(1, 200, (4, 8))),
        mask,
    )
    batch = batch.replace(old_log_probs=-mask, advantages=mask)
    update = jax.jit(passes.update_actor, static_argnums=(0, 4), donate_argnums=1)
    with _fresh():
        start = time.perf_counter()
        update.lower(graphdef, state, batch, jax.random.key(0), cfg).compile()
        return time.perf_counter() - start


def decode_compile_s(config: ModelConfig) -> float:
    """Trace + lowering + compile seconds of a fresh engine's first decode call."""
    engine_config = RolloutConfig(
        page_size=4, max_num_seqs=2, prompt_length=8, response_length=8, decode_steps_per_call=4
    )
    engine = Engine(CausalLM(config, nnx.Rngs(0)), engine_config)
    sp = SamplingParams(n=1, temperature=0.0, max_tokens=8, ignore_eos=True)
    for slot, prefix in enumerate(engine.prefill([Request((1, 2, 3, 4, 5), sp)])):
        engine.insert(prefix, slot)
    with _fresh():
        before = _seconds["total"]
        engine.generate(num_steps=4)
        return _seconds["total"] - before


def dense_decode_compile_s(config: ModelConfig) -> float:
    """Seconds to lower and compile 4 greedy decode steps on a `DenseKVCache`."""
    graphdef, params = nnx.split(CausalLM(config, nnx.Rngs(0)))
    cache = DenseKVCache.create(config, 2, 16)

    def steps(params, cache, tokens_B, positions_B):
        model = nnx.merge(graphdef, params)

        def one(carry, t):
            cache, tokens_B = carry
            step = (tokens_B[:, None], positions_B[:, None] + t, jnp.ones((2, 1), bool), cache)
            logits, cache = model.decode(*step)
            return (cache, jnp.argmax(logits[:, -1], axis=-1)), None

        return jax.lax.scan(one, (cache, tokens_B), jnp.arange(4))[0]

    args = (params, cache, jnp.ones((2,), jnp.int32), jnp.full((2,), 5, jnp.int32))
    with _fresh():
        start = time.perf_counter()
        jax.jit(steps).lower(*args).compile()
        return time.perf_counter() - start


MEASURES = (
    ("update_actor_s", update_compile_s),
    ("decode_s", decode_compile_s),
    ("dense_decode_s", dense_decode_compile_s),
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="4,8,16,28")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "compile_depth"))
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    depths = [int(n) for n in args.layers.split(",")]
    # one discarded round first: the process's one-time costs (first traces of shared helpers,
    # backend start-up) would otherwise land in the first row
    for _, fn in MEASURES:
        fn(ModelConfig(**WIDTH, num_hidden_layers=1))
    rows = []
    for layers in depths:
        for scan in (False, True):
            config = ModelConfig(**WIDTH, num_hidden_layers=layers, scan_layers=scan)
            row = {"layers": layers, "scan_layers": scan}
            for name, fn in MEASURES:
                row[name] = statistics.median(fn(config) for _ in range(args.repeats))
            print(json.dumps(row), flush=True)
            rows.append(row)
    ratios = {}
    for scan in (False, True):
        first, last = (next(r for r in rows if r["layers"] == n and r["scan_layers"] is scan)
                       for n in (depths[0], depths[-1]))  # fmt: skip
        for name, _ in MEASURES:
            key = f"{name.removesuffix('_s')}_{depths[-1]}/{depths[0]}_scan_{scan}"
            ratios[key] = last[name] / first[name]
    result = {"width": WIDTH, "repeats": args.repeats, "backend": jax.default_backend(),
              "rows": rows, "ratios": ratios}  # fmt: skip
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_depth.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(ratios, indent=1))
    return result


if __name__ == "__main__":
    main()
