"""Partial rollouts against a long tail: `sync` vs `async` vs `async` + `trainer.partial_rollout`
on the quick start (configs/quickstart.py: GRPO, the shipped 3.4M SFT model, 16 prompts × 8).

Long tail (forced, the same in every mode): the response length is raised to
`--response_length` (default 64) and the samples of every 8th prompt (request index ≡ 0 mod
8: 2 of a batch's 16 prompts) ignore EOS (`SamplingParams.ignore_eos` set at insertion), so
they run to the full length while the others stop after their answer (≈ 10 tokens): 1 in 8
responses is ~6× longer than the rest.

Modes (all on the same split pools, `--devices` simulated CPU devices: the rollout on one,
training on the others, as asynchrony needs):
    sync     rollout_mode=sync
    async    rollout_mode=async, staleness_threshold=1 (each batch requested one step ahead)
    partial  rollout_mode=async, partial_rollout=True, staleness_threshold=`--threshold`
    partial_keep  the same with partial_rollout_kv=keep (no re-prefill at a swap)
             (default 8; each round requested one step ahead, as `async`): a long response
             spans several rounds, and one older than the bound would be regenerated

Reported per mode (after `--warmup` untimed steps — 8 by default: with partial rollouts the
long responses pile up in flight until the first of them finish, ~7 rounds after they start,
so earlier batches hold mostly short ones — medians over `--steps` timed steps):
steps/hour (3600 / median `timing_s/step`), the trainer's wait for the batch
(`timing_s/wait_rollout`), the `async/*` metrics, and the tail fraction: the fraction of the
engine's decode wall time (its `generate` calls) spent in calls that start with fewer than a
quarter of the run's peak number of running sequences — decode time spent waiting for the
longest sequences while most slots sit idle — and the same fraction of decode steps
(`tail_fraction_steps`: what a latency-bound accelerator pays; on this CPU a decode step
costs about its active rows, and the rollout thread shares the cores with training, so the
seconds mix in contention). Writes
`experiments/results/partial_rollout/<timestamp>.json`.

    python -m experiments.benchmarks.partial_rollout [--steps 4] [--modes sync,async,partial]

On a CPU host the simulated devices share the same cores, so the overlap of generation and
training gains at most what the cores leave idle; the tail fraction does not depend on that.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
LONG_EVERY = 8  # the samples of every 8th prompt ignore EOS
TAIL_SHARE = 0.25  # a decode call with < 25% of the peak running sequences is tail


def modes(threshold: int) -> dict[str, dict]:
    """Mode name -> trainer keys."""
    return {
        "sync": {"trainer.rollout_mode": "sync"},
        "async": {"trainer.rollout_mode": "async", "trainer.staleness_threshold": 1},
        "partial": {
            "trainer.rollout_mode": "async",
            "trainer.staleness_threshold": threshold,
            "trainer.partial_rollout": True,
        },
        "partial_keep": {  # the carried sequences keep their keys/values at a swap
            "trainer.rollout_mode": "async",
            "trainer.staleness_threshold": threshold,
            "trainer.partial_rollout": True,
            "trainer.partial_rollout_kv": "keep",
        },
    }


def trainer_config(changes: dict, args, run_dir: pathlib.Path):
    """The quick start with the long response length, split pools and `changes`."""
    sys.path.insert(0, str(ROOT))
    from tests.rl.tiny_run import load_config_file

    c = load_config_file("quickstart")
    c.data.max_response_length = c.actor_rollout_ref.rollout.response_length = args.response_length
    c.data.val_files = ""
    t = c.trainer
    t.default_local_dir = str(run_dir)
    t.logger, t.progress_bar, t.resume_mode = (), False, "disable"
    t.val_before_train, t.test_freq, t.save_freq = False, -1, -1
    t.total_training_steps = args.warmup + args.steps
    c.resource_pool = dict(
        global_pool=dict(n_devices=args.devices - 1), rollout_pool=dict(n_devices=1)
    )
    c.placement.rollout = "rollout_pool"
    c.update_from_flattened_dict(changes)
    return c


def force_long_tail(engine) -> None:
    """Every `LONG_EVERY`-th request's samples ignore EOS (they run to max_tokens)."""
    insert = engine.insert

    def long_insert(prefix, slot):
        request = prefix.request
        if request.index % LONG_EVERY == 0 and not request.params.ignore_eos:
            params = dataclasses.replace(request.params, ignore_eos=True)
            prefix.request = dataclasses.replace(request, params=params)
        insert(prefix, slot)

    engine.insert = long_insert


def record_decode_calls(engine) -> list[tuple[int, float, int]]:
    """(running sequences at the start, seconds, decode steps) of each `engine.generate`
    call."""
    calls: list[tuple[int, float, int]] = []
    generate = engine.generate

    def timed_generate(*args, **kwargs):
        active, start, steps = engine.num_active, time.perf_counter(), engine.num_decode_steps
        out = generate(*args, **kwargs)
        calls.append((active, time.perf_counter() - start, engine.num_decode_steps - steps))
        return out

    engine.generate = timed_generate
    return calls


def tail_fraction(calls: list[tuple[int, float, int]], column: int) -> float:
    """Fraction of decode seconds (`column` 1) or decode steps (2) in calls starting with
    < TAIL_SHARE × the peak running sequences."""
    peak = max(call[0] for call in calls)
    tail = sum(call[column] for call in calls if call[0] < TAIL_SHARE * peak)
    return tail / max(sum(call[column] for call in calls), 1)


def run_mode(name: str, changes: dict, args, work: pathlib.Path) -> dict:
    from hybridjax.rl.trainer import RLTrainer

    trainer = RLTrainer(trainer_config(changes, args, work / name))
    force_long_tail(trainer.engine)
    calls = record_decode_calls(trainer.engine)
    steps, first_timed = [], 0
    try:
        for n in range(1, args.warmup + args.steps + 1):
            if n == args.warmup + 1:
                first_timed = len(calls)
            steps.append(trainer.train_step(n))
    finally:
        trainer.close()
    timed = steps[args.warmup :]
    med = lambda key: statistics.median(m.get(key, 0.0) for m in timed)  # noqa: E731
    keys = sorted({k for m in timed for k in m if k.startswith("async/")})
    long = [m["response_length/max"] for m in timed if "response_length/max" in m]
    result = {
        "trainer_keys": changes,
        "step_time_s": med("timing_s/step"),
        "steps_per_hour": 3600.0 / med("timing_s/step"),
        "wait_rollout_s": med("timing_s/wait_rollout"),
        "gen_s": med("timing_s/rollout_gen") or med("timing_s/gen"),
        "tail_fraction": tail_fraction(calls[first_timed:], 1),
        "tail_fraction_steps": tail_fraction(calls[first_timed:], 2),
        "decode_steps": sum(c[2] for c in calls[first_timed:]),
        "decode_calls": len(calls) - first_timed,
        "response_length_mean": med("response_length/mean"),
        "response_length_max": max(long) if long else None,
        "reward_mean": med("critic/score/mean"),
        "medians": {k: med(k) for k in keys},
    }
    if trainer.partial is not None:
        result["recomputed_sequences"] = trainer.partial.num_recomputed
        result["regenerated_groups"] = trainer.partial.num_regenerated
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--threshold", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--modes", default="sync,async,partial")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    known = modes(args.threshold)
    names = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown} (valid: {list(known)})")
    with tempfile.TemporaryDirectory() as work:
        results = {m: run_mode(m, known[m], args, pathlib.Path(work)) for m in names}
    summary = dict(
        config="configs/quickstart.py",
        response_length=args.response_length,
        long_every=LONG_EVERY,
        tail_share=TAIL_SHARE,
        warmup=args.warmup,
        steps=args.steps,
        devices=args.devices,
        modes=results,
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d_%H%M%S")
    out = pathlib.Path(args.out or ROOT / "experiments" / "results" / "partial_rollout")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stamp}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
