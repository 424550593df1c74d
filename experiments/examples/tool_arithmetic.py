"""The calculator-tool demonstration, measured end to end on the CPU:

    python -m experiments.examples.tool_arithmetic [--sft_steps 120] [--steps 30] \
        [--warm_start DIR]

writes the task (`hybridjax.data.arithmetic_tools`), fine-tunes the quick start's warm start on
the tool-calling teacher (`python -m hybridjax.sft` with `configs/sft_arithmetic_tools.py`;
skipped with `--warm_start`), measures the warm start greedily on the 256 held-out problems,
trains it with GRPO and the calculator (`configs/arithmetic_tools.py`, multi-turn rollouts),
measures it again, and writes `results/<timestamp>/tool_arithmetic.json`.

Measured, per held-out split (easy: the quick start's problems; hard: 2-digit × 2-digit):
`accuracy` (GSM8K's strict reward), `tool_use` (share of problems with at least one call),
`call_success` (share of calls that parsed and ran without error), and the mean number of
calls; plus the training curve's `multi_turn/*` metrics and reward at temperature 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import numpy as np

from experiments.benchmarks.run import results_dir
from experiments.examples.dpo_arithmetic import load_config_file
from hybridjax.data.arithmetic_tools import write_task
from hybridjax.rewards import decode_responses, default_compute_score
from hybridjax.sft import run_sft
from hybridjax.trainer.generation import generate_batch


def evaluate(trainer) -> dict:
    """Greedy (`rollout.val_kwargs`) multi-turn rollouts of the trainer's current weights on its
    validation files, scored with the task's reward; rates per split ("easy", "hard", "all")."""
    rows = []
    sampling = trainer.sampling(trainer.global_step, validate=True)
    for prompts in trainer.val_loader.iter_epoch():
        _, host = generate_batch(
            trainer.engine,
            prompts,
            sampling,
            trainer.tokenizer.pad_token_id,
            trainer.batch_sharding,
            0,
            trainer.multi_turn,
        )
        texts = decode_responses(trainer.tokenizer, host.responses, host.valid_mask)
        for i in np.flatnonzero(host.row_mask):
            info = host.extra_info[i]
            score = default_compute_score(host.data_source[i], texts[i], host.ground_truth[i])
            calls = info["tool_calls"]
            rows.append((info["hard"], float(score), len(calls), sum(c["error"] for c in calls)))
    summary = {}
    for split, keep in (("easy", False), ("hard", True), ("all", None)):
        chosen = [r for r in rows if keep is None or r[0] == keep]
        calls = sum(r[2] for r in chosen)
        summary[split] = {
            "problems": len(chosen),
            "accuracy": round(float(np.mean([r[1] for r in chosen])), 4),
            "tool_use": round(float(np.mean([r[2] > 0 for r in chosen])), 4),
            "calls": calls,
            "call_success": round(1 - sum(r[3] for r in chosen) / calls, 4) if calls else None,
        }
    return summary


def warm_start(data: dict[str, str], steps: int, out: pathlib.Path) -> tuple[str, float]:
    """(path, wall seconds) of the SFT warm start trained on the task's teacher."""
    c = load_config_file("sft_arithmetic_tools")
    c.data.train_files = data["sft"]
    c.trainer.total_training_steps = steps
    c.trainer.default_local_dir = str(out / "sft")
    c.trainer.output_dir = str(out / "sft_model")
    c.trainer.logger = ("jsonl",)
    tic = time.perf_counter()
    run_sft(c)
    return c.trainer.output_dir, time.perf_counter() - tic


def curve(path: pathlib.Path) -> dict:
    """The training metrics of the first and last steps (temperature 1)."""
    keys = (
        "critic/score/mean",
        "multi_turn/tool_calls",
        "multi_turn/tool_errors",
        "multi_turn/num_turns_mean",
        "response_length/mean",
    )
    records = [json.loads(line) for line in open(path)]
    steps = [r for r in records if "critic/score/mean" in r]
    return {
        f"step_{r['step']}": {k: round(r[k], 4) for k in keys if k in r}
        for r in (steps[0], steps[-1])
    }


def run(sft_steps: int, steps: int, lr: float, warm: str | None, out: pathlib.Path) -> dict:
    from hybridjax.trainer.trainer import RLTrainer

    data = write_task(str(out / "data"))
    sft_s = None
    if warm is None:
        warm, sft_s = warm_start(data, sft_steps, out)
    c = load_config_file("arithmetic_tools")
    c.data.train_files, c.data.val_files = data["train"], data["test"]
    c.actor_rollout_ref.model.path = warm
    c.actor_rollout_ref.actor.optim.lr = lr
    c.trainer.total_training_steps = steps
    c.trainer.val_before_train = False  # measured here, with the tool-use rates
    c.trainer.test_freq = -1
    c.trainer.default_local_dir = str(out / "grpo")
    c.trainer.logger = ("jsonl",)
    trainer = RLTrainer(c)
    try:
        before = evaluate(trainer)
        print("before:", json.dumps(before), flush=True)
        tic = time.perf_counter()
        trainer.fit()
        grpo_s = time.perf_counter() - tic
        after = evaluate(trainer)
        print("after:", json.dumps(after), flush=True)
    finally:
        trainer.close()
    return {
        "sft_steps": sft_steps if sft_s is not None else None,
        "sft_wall_s": None if sft_s is None else round(sft_s, 1),
        "grpo_steps": steps,
        "grpo_lr": lr,
        "grpo_wall_s": round(grpo_s, 1),
        "greedy_held_out": {"before": before, "after": after},
        "training": curve(out / "grpo" / "logs" / "metrics.jsonl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft_steps", type=int, default=120)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warm_start", default=None, help="an SFT warm start (skips the SFT)")
    parser.add_argument("--results", default="results")
    args = parser.parse_args()
    out = results_dir(args.results)
    summary = run(args.sft_steps, args.steps, args.lr, args.warm_start, out)
    (out / "tool_arithmetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written to {os.path.join(out, 'tool_arithmetic.json')}")


if __name__ == "__main__":
    main()
