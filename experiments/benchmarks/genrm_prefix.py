"""Judge prefill with and without prefix sharing (`hybridjax.rewards.genrm`).

A random Qwen2-shaped judge (hidden 128, 4 layers) on the paged engine judges `--prompts`
prompts × `--n` responses: each judge prompt is a `--prefix`-token template head + prompt and a
`--response`-token response, and the judge writes `--verdict` tokens (greedy, EOS ignored).
(a) `shared`: one request per prompt, its prefix prefilled once, each response extended on top
(`generate_after_prefixes`, what the judge runs); (b) `whole`: every judge prompt its own
request (`generate`), the baseline. Reported: tokens prefilled and the median wall time of
`--steps` runs after one warm-up (compiles), and whether both give the same verdict tokens.

    python -m experiments.benchmarks.genrm_prefix [--steps 3] [--out DIR]

Writes `DIR/genrm_prefix.json` (default `results/YYYYMMDD_HHMMSS_genrm_prefix/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=384)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--verdict", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
    from hybridjax.rollout.batching import generate_after_prefixes

    config = ModelConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=True)  # fmt: skip
    engine = Engine(
        CausalLM(config, nnx.Rngs(0)),
        RolloutConfig(
            max_num_seqs=args.prompts * args.n,
            prompt_length=args.prefix + args.response,
            response_length=args.verdict,
            decode_steps_per_call=args.verdict,
        ),
    )
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 1000, args.prefix).tolist() for _ in range(args.prompts)]
    conts = [
        [rng.integers(1, 1000, args.response).tolist() for _ in range(args.n)] for _ in prefixes
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.verdict, ignore_eos=True)
    whole = [p + c for p, g in zip(prefixes, conts, strict=True) for c in g]
    runs = {
        "shared": lambda: generate_after_prefixes(engine, prefixes, conts, params),
        "whole": lambda: generate(engine, whole, params).responses.tolist(),
    }
    machine = {"cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}
    out: dict = {"args": vars(args), "backend": jax.default_backend(), "machine": machine}
    tokens = {}
    for name, run in runs.items():
        tokens[name] = run()  # warm-up: compiles
        times, before = [], engine.num_prefill_tokens
        for _ in range(args.steps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        prefilled = (engine.num_prefill_tokens - before) // args.steps
        out[name] = {"median_s": statistics.median(times), "times_s": times,
                     "prefill_tokens": prefilled}  # fmt: skip
        print(name, f"{out[name]['median_s']:.3f} s, {prefilled} tokens prefilled", flush=True)
    out["same_verdicts"] = tokens["shared"] == tokens["whole"]
    out["speedup"] = out["whole"]["median_s"] / out["shared"]["median_s"]
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    out_dir = pathlib.Path(args.out or f"results/{stamp}_genrm_prefix")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "genrm_prefix.json").write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("same_verdicts", "speedup")}))


if __name__ == "__main__":
    main()
