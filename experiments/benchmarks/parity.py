"""Parity mode (`actor_rollout_ref.model.batch_invariant`) on the quick start's model, CPU:
what it costs and what it buys, parity on and off in one run, float32 and bfloat16.

* cost: tokens/s of rollout (`generate` of 8 quick-start prompts × 4 samples, up to 32
  tokens each, temperature 1; generated tokens / wall time) and of the `old_log_prob` pass
  (`hybridjax.training.forward.model_log_probs` over those 32 sequences in one call; response
  tokens / wall time), each the median of `--repeats` timed runs after a warm-up (compiles
  excluded), the two modes' runs in alternation; the ratio on / off;
* effect: the tokens whose log-prob differs (and max |Δ log p|) between the engine and the
  trainer's pass over the same sequences, and between scoring 8 sequences at batch 8 and at
  batch 1 (`mismatch.batch_invariance`, verl #6280's measurement).

    nice -n 19 python -m experiments.benchmarks.parity [--out DIR] [--repeats N]

Writes `DIR/parity.json` (default `experiments/results/YYYYMMDD_HHMMSS_parity/`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.mismatch import ROOT, batch_invariance, quickstart_prompts

MODEL = ROOT / "hybridjax" / "assets" / "quickstart" / "sft_model"
SAMPLES, MAX_TOKENS = 4, 32
STAGES = ("rollout", "old_log_prob")


def _alternating_medians(fns: dict, repeats: int) -> dict:
    """Median wall seconds of each of `fns` (name -> fn) over `repeats` rounds, one run of
    each per round in turn (so a shared machine's load falls on all alike), after one
    untimed run of each."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _fields(prompts, out):
    """The trainer's padded fields of the rollout `out` (rows prompt-major, SAMPLES each)."""
    from hybridjax.training.batch import make_batch

    width = max(map(len, prompts))
    rows = [p for p in prompts for _ in range(SAMPLES)]
    ids = np.array([[0] * (width - len(p)) + list(p) for p in rows], np.int32)
    mask = (np.arange(width)[None] >= width - np.array([len(p) for p in rows])[:, None]).astype(
        np.int32
    )
    batch = make_batch(
        jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(out.responses),
        jnp.asarray(out.response_mask),
    )  # fmt: skip
    return {
        "input_ids": jnp.concatenate([batch.prompts, batch.responses], axis=1),
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "responses": batch.responses,
    }


def setup(dtype: str, on: bool) -> dict:
    """One mode's timed work (`rollout`, `old_log_prob`: callables) and its measured
    engine/trainer gap and batch-1-vs-8 mismatch."""
    from hybridjax.models.hf_io import load_pretrained
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate
    from hybridjax.training.forward import model_log_probs

    overrides = {"dtype": dtype, "param_dtype": dtype, "batch_invariant": on}
    model = load_pretrained(MODEL, config_overrides=overrides)
    prompts = quickstart_prompts(8)
    config = RolloutConfig(
        page_size=16, max_num_seqs=32, prompt_length=max(map(len, prompts)),
        response_length=MAX_TOKENS, decode_steps_per_call=8,
    )  # fmt: skip
    engine = Engine(model, config)
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)
    out = generate(engine, prompts, params)
    fields = _fields(prompts, out)
    score = jax.jit(lambda f: model_log_probs(model, f, 1.0)[0])
    mask = out.response_mask > 0
    delta = np.abs(np.asarray(score(fields)) - out.rollout_log_probs)[mask]
    return {
        "rollout": lambda: generate(engine, prompts, params).responses,
        "old_log_prob": lambda: score(fields),
        "response_tokens": int(mask.sum()),
        "engine_vs_trainer_differing_tokens": int((delta > 0).sum()),
        "engine_vs_trainer_max_abs_log_prob_diff": float(delta.max()),
        "batch_1_vs_8": batch_invariance(dtype, batch_invariant=on),
    }


def measure(dtype: str, repeats: int) -> dict:
    """Both modes of `dtype`: rollout and old_log_prob tokens/s, timed in alternation, the
    ratios on / off, and each mode's mismatch."""
    modes = {name: setup(dtype, on) for name, on in (("off", False), ("on", True))}
    fns = {(mode, work): modes[mode].pop(work) for mode in modes for work in STAGES}
    seconds = _alternating_medians(fns, repeats)
    for (mode, work), s in seconds.items():
        modes[mode][f"{work}_tokens_per_s"] = modes[mode]["response_tokens"] / s
    for work in STAGES:
        key = f"{work}_tokens_per_s"
        modes[f"{key}_on_over_off"] = modes["on"][key] / modes["off"][key]
    return modes


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    out = pathlib.Path(args.out or ROOT / "experiments" / "results" / f"{stamp}_parity")
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"backend": jax.default_backend(), "devices": jax.device_count()}
    for dtype in ("float32", "bfloat16"):
        modes = measure(dtype, args.repeats)
        summary[dtype] = modes
        print(json.dumps({dtype: modes}, indent=2), flush=True)
    (out / "parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
