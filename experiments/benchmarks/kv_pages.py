"""KV pages reserved at admission against pages on demand with preemption, same pool memory.

`python -m experiments.benchmarks.kv_pages [--prompts=32] [--n=4] [--num_pages=96] ...`
writes `experiments/results/kv_pages/summary.json` (or `--out`). `--devices=8` runs it on 8
simulated CPU devices as a generation mesh of `devices / tensor` data replicas, each with its
own pool of `num_pages` pages and `max_num_seqs` slots (`hybridjax.rollout.replicas`).

A GRPO-shaped rollout with a tiny Qwen2-shaped model (random weights):
`prompts` prompts of `prompt_len` tokens × `n` samples at temperature 1, max_tokens =
`response_length`, a response ending at any of `num_stop_ids` stop ids: near-uniform logits
make its length near-geometric (mean ≈ vocab / num_stop_ids, a long tail up to the cap), as
EOS ends GSM8K-like responses at unknown lengths. Both engines get the same pool of
`num_pages` pages of `page_size` tokens and `max_num_seqs` slots, far more than the pool holds
at full length, so the pool bounds what runs:

* `reserve` (`rollout.page_allocation=reserve`): a group is admitted once the pool holds every
  sample at prompt + max_tokens (the worst case);
* `on_demand` (the default): a sequence takes pages as it grows; when none is free the youngest
  are preempted and recomputed later (`hybridjax.rollout.preemption`); a group is admitted
  only if `watermark` of the pool stays free after its pages (`RolloutConfig.watermark`).

Per mode: sequences running per decode call (mean and peak, sampled before each call; in all
and per replica, i.e. per device at `tensor=1`), decode
steps and calls, preemptions, recomputed (prefill) tokens, generated tokens per second over the
whole rollout (median of `repeats` runs after a warm-up run that compiles every shape;
`--no_warmup` times the first run, compiles included, for shapes too slow to run twice) and
whether the samples equal the reserve engine's. `--unpreempted_pages=N` adds a third run,
`on_demand_unpreempted`, on N pages per replica (enough that nothing is preempted): its
samples differ from reserve's only by what another decode batch changes (which sequences run
together), so the divergences it shares with `on_demand` are not preemption's, and
`on_demand`'s `samples_differing_from_unpreempted` counts what preemption changes. On a CPU a
decode step costs in proportion to its rows, so running more sequences per step saves wall
time only where a step is bound by reading the weights (a GPU decoding a real model): there
fewer decode steps for the same tokens is the gain.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np


def _divergences(out, reference) -> list[dict]:
    """Per sample whose tokens differ from the reference's: its row, the first differing
    position, the log-probs there (this run's, the reference's) and the largest log-prob
    difference before it (where both ran the same tokens: float noise, or not)."""
    rows = []
    for i in np.flatnonzero((out.responses != reference.responses).any(axis=1)):
        t = int(np.flatnonzero(out.responses[i] != reference.responses[i])[0])
        before = np.abs(out.rollout_log_probs[i, :t] - reference.rollout_log_probs[i, :t])
        rows.append(
            dict(
                row=int(i),
                position=t,
                log_probs=[
                    float(out.rollout_log_probs[i, t]),
                    float(reference.rollout_log_probs[i, t]),
                ],
                max_log_prob_diff_before=float(before.max()) if t else 0.0,
            )
        )
    return rows


def run(args: argparse.Namespace) -> dict:
    import jax
    from flax import nnx

    from hybridjax.models.config import ModelConfig
    from hybridjax.models.decoder import CausalLM
    from hybridjax.rollout import Engine, RolloutConfig, SamplingParams, generate

    model_config = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = CausalLM(model_config, nnx.Rngs(0))
    mesh = None
    if args.devices > 1:
        from hybridjax.sharding import MeshConfig, make_meshes

        sizes = (args.devices // args.tensor, args.tensor)
        mesh = make_meshes(MeshConfig(generate=sizes), jax.devices()[: args.devices]).generate
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(1, 256, size=(args.prompts, args.prompt_len)).tolist()
    params = SamplingParams(
        n=args.n,
        temperature=1.0,
        max_tokens=args.response_length,
        stop_token_ids=tuple(range(1, args.num_stop_ids + 1)),
        ignore_eos=True,
        seed=7,
    )
    results, reference, outs = {}, None, {}
    runs = [("reserve", "reserve", args.num_pages), ("on_demand", "on_demand", args.num_pages)]
    if args.unpreempted_pages:
        runs.append(("on_demand_unpreempted", "on_demand", args.unpreempted_pages))
    for name, mode, pool_pages in runs:
        config = RolloutConfig(
            page_size=args.page_size,
            num_pages=pool_pages,
            max_num_seqs=args.max_num_seqs,
            prompt_length=args.prompt_len,
            response_length=args.response_length,
            decode_steps_per_call=args.decode_steps_per_call,
            page_allocation=mode,
            watermark=args.watermark,
        )
        engine = Engine(model, config, mesh=mesh)
        replicas = engine.replicas
        if not args.no_warmup:
            generate(engine, prompts, params)  # warm-up: compiles every shape this rollout uses
        running: list[int] = []
        per_replica: list[int] = []  # the busiest replica's running sequences, per call
        decode = engine.generate

        def counted(*a, _decode=decode, **k):
            active = np.asarray(engine.slots.active).reshape(replicas, -1).sum(axis=1)
            running.append(int(active.sum()))
            per_replica.append(int(active.max()))
            return _decode(*a, **k)

        engine.generate = counted  # type: ignore[method-assign]
        stats = (engine.num_decode_steps, engine.num_preemptions, engine.num_prefill_tokens)
        start = time.perf_counter()
        out = generate(engine, prompts, params)
        walls = [time.perf_counter() - start]
        counts = (engine.num_decode_steps, engine.num_preemptions, engine.num_prefill_tokens)
        for _ in range(args.repeats - 1):  # same work again: only the wall time is kept
            start = time.perf_counter()
            generate(engine, prompts, params)
            walls.append(time.perf_counter() - start)
        wall = float(np.median(walls))
        generated = int(out.response_mask.sum())
        if reference is None:
            reference = out
        outs[name] = out
        running = running[: len(running) // args.repeats]  # the first run's calls
        per_replica = per_replica[: len(running)]
        busy = [r for r in running if r]
        results[name] = dict(
            mean_running_seqs=float(np.mean(busy)),
            peak_running_seqs=int(max(running)),
            mean_running_seqs_per_replica=float(np.mean(busy)) / replicas,
            peak_running_seqs_per_replica=int(max(per_replica)),
            decode_calls=len(running),
            decode_steps=counts[0] - stats[0],
            preemptions=counts[1] - stats[1],
            prefill_tokens=counts[2] - stats[2],
            generated_tokens=generated,
            tokens_per_decode_step=generated / max(counts[0] - stats[0], 1),
            wall_s=wall,
            wall_s_runs=walls,
            tokens_per_s=generated / wall,
            same_samples_as_reserve=bool(
                np.array_equal(out.responses, reference.responses)
                and np.array_equal(out.response_mask, reference.response_mask)
            ),
            samples_differing_from_reserve=int(
                (out.responses != reference.responses).any(axis=1).sum()
            ),
            divergences=_divergences(out, reference),
            max_log_prob_diff_to_reserve=float(
                np.abs(
                    (out.rollout_log_probs - reference.rollout_log_probs) * out.response_mask
                ).max()
            ),
        )
    if "on_demand_unpreempted" in outs:  # preemption's own effect: same engine, no preemption
        got, unpreempted = outs["on_demand"], outs["on_demand_unpreempted"]
        results["on_demand"]["samples_differing_from_unpreempted"] = int(
            (got.responses != unpreempted.responses).any(axis=1).sum()
        )
        results["on_demand"]["divergences_from_unpreempted"] = _divergences(got, unpreempted)
    r, o = results["reserve"], results["on_demand"]
    lengths = reference.response_mask.sum(axis=1)
    return dict(
        settings=vars(args),
        replicas=args.devices // args.tensor,
        response_lengths=dict(
            mean=float(lengths.mean()),
            median=float(np.median(lengths)),
            p90=float(np.percentile(lengths, 90)),
            max=int(lengths.max()),
        ),
        pool_full_length_sequences=args.num_pages
        // -(-(args.prompt_len + args.response_length - 1) // args.page_size),
        modes=results,
        mean_running_ratio=o["mean_running_seqs"] / r["mean_running_seqs"],
        decode_steps_ratio=r["decode_steps"] / max(o["decode_steps"], 1),
        speedup=o["tokens_per_s"] / r["tokens_per_s"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--response_length", type=int, default=256)
    parser.add_argument("--num_stop_ids", type=int, default=6)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--num_pages", type=int, default=160)
    parser.add_argument("--max_num_seqs", type=int, default=64)
    parser.add_argument("--decode_steps_per_call", type=int, default=16)
    parser.add_argument(
        "--watermark", type=float, default=0.01, help="free pool fraction admission keeps"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median wall)")
    parser.add_argument("--no_warmup", action="store_true", help="time the first run")
    parser.add_argument("--devices", type=int, default=1, help="simulated CPU devices")
    parser.add_argument("--tensor", type=int, default=1, help="generation mesh tensor size")
    parser.add_argument(
        "--unpreempted_pages",
        type=int,
        default=0,
        help="also run on demand on this many pages per replica, enough that none is preempted",
    )
    parser.add_argument("--out", default="experiments/results/kv_pages/summary.json")
    args = parser.parse_args()
    if args.devices % args.tensor:
        parser.error(f"--devices={args.devices} is not a multiple of --tensor={args.tensor}")
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX makes its devices
    summary = run(args)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
