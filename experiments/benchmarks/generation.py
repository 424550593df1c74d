"""Generation benchmark: the rollout engine against HF `transformers` `generate`, same weights.

`python -m experiments.benchmarks.generation [--quick] [--models=4M,100M] [--batches=1,8,32]`
writes `results/YYYYMMDD_HHMMSS/{config.json,summary.json,log.txt,generation.png}` through
`experiments.benchmarks.run` (also reachable as `run --config=...` with
`benchmark="generation"`). `--quick` is a smoke test on a tiny model (well under a minute).

In one process, on the default (single) CPU device:

1. peak float32 matmul FLOP/s of this machine (`hybridjax.metrics.flops.measure_peak_flops`);
2. for each Qwen2-shaped model (random weights, tied embeddings; ~4M: hidden 256 × 4 layers,
   ~100M: hidden 768 × 12 layers) and batch size: tokens/s of
   * hybridjax: `hybridjax.rollout.generate` on an `Engine` with `max_num_seqs` = batch;
   * HF: `AutoModelForCausalLM.generate` on the checkpoint written by
     `hybridjax.models.hf_io.save_pretrained`, torch on `hf_threads` threads;
   both sample at temperature 1 with no top-k/top-p, `prompt_len` prompt tokens, exactly
   `new_tokens` new tokens (EOS ignored), median wall time over `repeats` after a warm-up
   (prefill included); repeats alternate peak, hybridjax and HF so that both see the same
   machine load. Roofline fraction = new tokens/s × 2 × parameters / (median) peak FLOP/s;
   `*_mfu` counts the prompt tokens too (each processed once, in the prefill);
3. continuous vs static batching (4M model): `requests` prompts with stop ids chosen so that
   response lengths spread over 8 .. new_tokens, on `max_num_seqs` slots; the same engine with
   refills as slots free (continuous) and refilling only when every slot finished (static);
4. small batch, long responses (`small_*` settings; 4M model): `small_prompts` prompts ×
   `small_n` samples, each of `small_new_tokens` lengths (EOS ignored), on engines whose
   `max_num_seqs` is each of `small_max_num_seqs` (the default 256 against the batch itself, a
   hand-tuned pool): the decode loop should cost the same whatever the pool's size. Reports
   median wall and CPU seconds per `generate`, their ratio to the smallest pool, the decode
   rows run and whether every pool gave the same tokens.

Each batch also times the model's weight matrices multiplied by a batch-row input (one decode
step's dots and nothing else): `matmul_only_roofline`, the fraction of the peak that XLA's CPU
dots reach with that few rows, the practical ceiling of any decoder on this machine.

Summary keys: `peak_flops`, `models.<name>.{params, batches.<B>.{hybridjax_tok_s, hf_tok_s,
ratio, hybridjax_roofline, hf_roofline, hybridjax_mfu, hf_mfu, matmul_only_roofline}}`,
`continuous.{continuous_s, static_s, speedup, lengths, step_ratio}` (step_ratio: decode steps
static ÷ continuous, the speed-up if prefill were free and every step cost the same),
`small_batch.<new_tokens>.{<max_num_seqs>_s, <max_num_seqs>_cpu_s, ratio_<max_num_seqs>,
ratio_<max_num_seqs>_cpu, decode_rows, same_tokens, compiles}` (ratio: seconds on that pool ÷
seconds on the smallest; decode_rows: rows × steps the decode loop ran, padding included).
`sections` picks the parts to run (`models`, `continuous`, `small_batch`). The machine may be
shared with other work: read ratios.
"""

from __future__ import annotations

import logging
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np
from ml_collections import ConfigDict

log = logging.getLogger(__name__)

# Qwen2-shaped models (q/k/v bias, tied embeddings).
MODELS = {
    "4M": dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "100M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # Qwen2.5-0.5B's shape (494M), for experiments/gpu/check.sh
    "0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}  # fmt: skip


def default_config(quick: bool = False) -> ConfigDict:
    """Settings of the `generation` benchmark (the `generation` node of a benchmark config)."""
    if quick:
        return ConfigDict(
            dict(models="tiny", batches="1,4", prompt_len=16, new_tokens=16, repeats=1,
                 hf_threads=1, continuous_model="tiny", requests=16, max_num_seqs=4,
                 page_size=8, decode_steps_per_call=8, sections="models,continuous,small_batch",
                 small_model="tiny", small_prompts=2, small_n=4, small_new_tokens="16",
                 small_max_num_seqs="64,8")
        )  # fmt: skip
    return ConfigDict(
        dict(models="4M,100M", batches="1,8,32", prompt_len=64, new_tokens=128, repeats=3,
             hf_threads=1, continuous_model="4M", requests=128, max_num_seqs=32, page_size=16,
             decode_steps_per_call=32, sections="models,continuous,small_batch", small_model="4M",
             small_prompts=2, small_n=4, small_new_tokens="64,512", small_max_num_seqs="256,8")
    )  # fmt: skip


def make_model(name: str, seed: int = 0):
    """A randomly initialised Qwen2-shaped `CausalLM` (std 0.02, the decoder's init)."""
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM

    config = ModelConfig(**MODELS[name], attention_bias=True, tie_word_embeddings=True)
    return CausalLM(config, nnx.Rngs(seed))


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _wall_and_cpu(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def hybridjax_runner(model, prompts: np.ndarray, cfg: ConfigDict):
    """(run, engine): `run()` generates `new_tokens` for the batch on an engine with
    `max_num_seqs` = batch."""
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate

    b, t = prompts.shape
    engine = Engine(
        model,
        RolloutConfig(page_size=cfg.page_size, max_num_seqs=b, prompt_length=t,
                      response_length=cfg.new_tokens,
                      decode_steps_per_call=cfg.decode_steps_per_call),
    )  # fmt: skip
    sp = SamplingParams(temperature=1.0, max_tokens=cfg.new_tokens, ignore_eos=True)
    return lambda: generate(engine, prompts, sp), engine


def hf_runner(checkpoint: pathlib.Path, prompts: np.ndarray, cfg: ConfigDict):
    """`run()`: HF `generate` (torch CPU, `hf_threads` threads) of `new_tokens` for the batch."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.hf_threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=cfg.new_tokens,
        min_new_tokens=cfg.new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=0,
    )  # fmt: skip

    def run():
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        assert out.shape == (ids.shape[0], ids.shape[1] + cfg.new_tokens), out.shape

    return run


def matmul_runner(model, batch: int):
    """(run, flop): `run()` multiplies a batch×in matrix by every weight matrix of the model
    (q/k/v/o, gate/up/down, the LM head), as one decode step does, in one jit. Its FLOP/s is
    the rate XLA's CPU dots reach at this many rows: the ceiling of the decode loop."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    weights = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w = var.get_value()
        if w.ndim < 2 or "bias" in str(path[-1]):
            continue
        if path[-1] == "o_proj":
            w = w.reshape(-1, w.shape[-1])
        elif path[-1] == "embed_tokens":
            w = w.T  # the tied LM head
        weights.append(w.reshape(w.shape[0], -1))
    inputs = {n: jnp.ones((batch, n), jnp.float32) for n in {w.shape[0] for w in weights}}
    chain = jax.jit(lambda ws, xs: [xs[w.shape[0]] @ w for w in ws])
    flop = sum(2 * batch * w.size for w in weights)
    return lambda: jax.block_until_ready(chain(weights, inputs)), flop


def bench_model(name: str, cfg: ConfigDict) -> dict:
    """Both systems on every batch size for model `name`. The machine may be shared, so each
    repeat measures the peak matmul rate, hybridjax and HF back to back (medians reported)."""
    from hybridjax.metrics.flops import measure_peak_flops
    from hybridjax.models.hf_io import save_pretrained

    model = make_model(name)
    params = model.config.num_params()
    flop_per_token = 2 * params
    rng = np.random.default_rng(0)
    batches = {}
    with tempfile.TemporaryDirectory(prefix="hybridjax_gen_bench_") as tmp:
        save_pretrained(model, tmp)
        for b in (int(x) for x in cfg.batches.split(",")):
            prompts = rng.integers(1, model.config.vocab_size, (b, cfg.prompt_len)).astype(np.int32)
            ours, engine = hybridjax_runner(model, prompts, cfg)
            hf = hf_runner(pathlib.Path(tmp), prompts, cfg)
            matmuls, matmul_flop = matmul_runner(model, b)
            ours(), hf(), matmuls()  # warm-up: compiles
            times = [
                (measure_peak_flops(1024), _seconds(ours), _seconds(hf), _seconds(matmuls))
                for _ in range(cfg.repeats)
            ]
            peak, ours_s, hf_s, mm_s = (statistics.median(x) for x in zip(*times, strict=True))
            tokens = b * cfg.new_tokens
            all_tokens = b * (cfg.prompt_len + cfg.new_tokens)
            row = dict(
                hybridjax_s=ours_s, hf_s=hf_s, hybridjax_tok_s=tokens / ours_s,
                hf_tok_s=tokens / hf_s, ratio=hf_s / ours_s, peak_flops=peak,
                hybridjax_roofline=tokens / ours_s * flop_per_token / peak,
                hf_roofline=tokens / hf_s * flop_per_token / peak,
                matmul_only_roofline=matmul_flop / mm_s / peak,
                # Prompt tokens are processed once too (prefill): FLOP utilisation of all work.
                hybridjax_mfu=all_tokens / ours_s * flop_per_token / peak,
                hf_mfu=all_tokens / hf_s * flop_per_token / peak,
                compiles=engine.num_compiles, all_times=times,
            )  # fmt: skip
            log.info("%s batch %d: %s", name, b, row)
            batches[str(b)] = row
    return dict(params=params, batches=batches)


def bench_continuous(cfg: ConfigDict) -> dict:
    """Continuous vs static batching on responses whose stop ids end them at 8 .. new_tokens.

    Random streams depend only on (seed, prompt, sample, step), so a first run without stop ids
    gives every response's tokens in advance; request i's stop id is its token at a drawn
    length where that token occurs for the first time (the nearest such position). Logits can
    differ in the last bits with the batch a prompt is prefilled in, which now and then flips a
    sampled token, so the lengths reported are those of the run, and `planned_lengths` is the
    share of responses that ended where planned.
    """
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate

    model = make_model(cfg.continuous_model)
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, model.config.vocab_size, (cfg.requests, cfg.prompt_len))
    engine = Engine(
        model,
        RolloutConfig(page_size=cfg.page_size, max_num_seqs=cfg.max_num_seqs,
                      prompt_length=cfg.prompt_len, response_length=cfg.new_tokens,
                      decode_steps_per_call=cfg.decode_steps_per_call),
    )  # fmt: skip
    base = SamplingParams(temperature=1.0, max_tokens=cfg.new_tokens, ignore_eos=True, seed=7)
    planned = generate(engine, prompts, base).responses
    params, lengths = [], []
    low = min(8, cfg.new_tokens)
    for row in planned:
        firsts = [j for j in range(low - 1, cfg.new_tokens) if row[j] not in row[:j]]
        target = int(rng.integers(low, cfg.new_tokens + 1)) - 1
        j = min(firsts, key=lambda f: abs(f - target)) if firsts else cfg.new_tokens - 1
        params.append(SamplingParams(**{**base.__dict__, "stop_token_ids": (int(row[j]),)}))
        lengths.append(j + 1)
    planned_lengths = lengths
    lengths = generate(engine, prompts, params).response_mask.sum(1).tolist()
    matched = float(np.mean(np.array(lengths) == np.array(planned_lengths)))
    static_run = lambda: generate(engine, prompts, params, continuous=False)
    steps = engine.num_decode_steps
    static_run()  # warm-up: static batches use other prefill buckets
    static_steps, steps = engine.num_decode_steps - steps, engine.num_decode_steps
    generate(engine, prompts, params)
    continuous_steps = engine.num_decode_steps - steps
    times = [
        (_seconds(lambda: generate(engine, prompts, params)), _seconds(static_run))
        for _ in range(cfg.repeats)
    ]
    continuous, static = (statistics.median(x) for x in zip(*times, strict=True))
    result = dict(
        continuous_s=continuous, static_s=static, speedup=static / continuous,
        tokens=int(sum(lengths)), tok_s_continuous=sum(lengths) / continuous,
        tok_s_static=sum(lengths) / static,
        lengths=dict(min=min(lengths), mean=float(np.mean(lengths)), max=max(lengths)),
        # Decode steps (all slots at once) each way: their ratio bounds the speed-up, since
        # both pay the same prefill.
        decode_steps_static=static_steps, decode_steps_continuous=continuous_steps,
        step_ratio=static_steps / continuous_steps,
        compiles=engine.num_compiles, planned_lengths=matched,
    )  # fmt: skip
    log.info("continuous vs static: %s", result)
    return result


def bench_small_batch(cfg: ConfigDict) -> dict:
    """`small_prompts` × `small_n` responses of each `small_new_tokens` length on engines of
    every `small_max_num_seqs` (same model, prompts and seed; one engine per pool size, warmed
    up once). A pool larger than the batch should cost nothing: `max_num_seqs` is a cap."""
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate

    model = make_model(cfg.small_model)
    rng = np.random.default_rng(2)
    prompts = rng.integers(1, model.config.vocab_size, (cfg.small_prompts, cfg.prompt_len))
    pools = [int(x) for x in cfg.small_max_num_seqs.split(",")]
    result = {}
    for new_tokens in (int(x) for x in cfg.small_new_tokens.split(",")):
        sp = SamplingParams(n=cfg.small_n, max_tokens=new_tokens, ignore_eos=True, seed=5)
        runs, tokens, compiles, rows = {}, {}, {}, {}
        for pool in pools:
            engine = Engine(
                model,
                RolloutConfig(page_size=cfg.page_size, max_num_seqs=pool,
                              prompt_length=cfg.prompt_len, response_length=new_tokens,
                              decode_steps_per_call=cfg.decode_steps_per_call),
            )  # fmt: skip
            before = engine.num_decode_rows
            tokens[pool] = generate(engine, prompts, sp).responses  # warm-up: compiles
            rows[pool] = engine.num_decode_rows - before
            runs[pool] = lambda engine=engine: generate(engine, prompts, sp)
            compiles[pool] = engine.num_compiles
        # Alternate the pools within each repeat, so both see the same machine load; CPU
        # seconds (all threads) move less than wall seconds when the machine is shared.
        times = [[_wall_and_cpu(runs[pool]) for pool in pools] for _ in range(cfg.repeats)]
        smallest = pools.index(min(pools))
        row = dict(rows=cfg.small_prompts * cfg.small_n, new_tokens=new_tokens,
                   same_tokens=all(np.array_equal(tokens[p], tokens[pools[0]]) for p in pools),
                   compiles={str(p): compiles[p] for p in pools},
                   decode_rows={str(p): rows[p] for p in pools}, all_times=times)  # fmt: skip
        for kind, k in (("s", 0), ("cpu_s", 1)):
            seconds = [
                statistics.median(t[k] for t in column) for column in zip(*times, strict=True)
            ]
            for pool, value in zip(pools, seconds, strict=True):
                row[f"{pool}_{kind}"] = value
                row[f"ratio_{pool}" + ("_cpu" if k else "")] = value / seconds[smallest]
        log.info("small batch, %d new tokens: %s", new_tokens, row)
        result[str(new_tokens)] = row
    return result


def run(cfg: ConfigDict, out_dir: pathlib.Path) -> dict:
    import jax

    from hybridjax.metrics.flops import measure_peak_flops

    sections = set(cfg.sections.split(","))
    unknown = sections - {"models", "continuous", "small_batch"}
    if unknown:
        raise ValueError(
            f"unknown sections {sorted(unknown)}; known: models, continuous, small_batch"
        )
    peak = measure_peak_flops(1024)
    log.info("peak %.1f GFLOP/s on %s", peak / 1e9, jax.devices()[0])
    summary = dict(peak_flops=peak, devices=str(jax.devices()), hf_threads=cfg.hf_threads)
    if "models" in sections:
        summary["models"] = {name: bench_model(name, cfg) for name in cfg.models.split(",")}
    if "continuous" in sections:
        summary["continuous"] = bench_continuous(cfg)
    if "small_batch" in sections:
        summary["small_batch"] = bench_small_batch(cfg)
    summary["peak_flops_after"] = measure_peak_flops(1024)  # the machine is shared: drift
    return summary


def plot(summary: dict, out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = summary.get("models")
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items(), strict=True):
        batches = list(m["batches"])
        x = np.arange(len(batches))
        ours = [m["batches"][b]["hybridjax_tok_s"] for b in batches]
        hf = [m["batches"][b]["hf_tok_s"] for b in batches]
        ax.bar(x - 0.2, ours, 0.4, label="hybridjax")
        ax.bar(x + 0.2, hf, 0.4, label="HF transformers")
        ax.set_xticks(x, [f"batch {b}" for b in batches])
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{name} ({m['params'] / 1e6:.1f}M params)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "generation.png", dpi=100)
    plt.close(fig)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model smoke test")
    args, rest = parser.parse_known_args()
    defaults = default_config(args.quick)
    for key in defaults:
        parser.add_argument(f"--{key}", type=type(defaults[key]), default=defaults[key])
    settings = ConfigDict({**defaults.to_dict(), **{
        k: v for k, v in vars(parser.parse_args()).items() if k != "quick"}})  # fmt: skip
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import jax

    jax.config.update("jax_platforms", "cpu")
    from experiments.benchmarks.run import run_benchmark

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(run_benchmark(ConfigDict(dict(benchmark="generation", generation=settings))))


if __name__ == "__main__":
    main()
