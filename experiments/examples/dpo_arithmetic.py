"""The DPO example, measured end to end on the CPU:

    python -m experiments.examples.dpo_arithmetic [--steps 40] [--lr 1e-4] [--lora_rank 0]

writes the preference pairs (`hybridjax.data.arithmetic_pairs`), measures the greedy accuracy
of the shipped warm start on the 256 held-out problems (the quick start's validation: strict
`#### n` reward), runs `python -m hybridjax.dpo` with `configs/dpo_arithmetic.py`, measures the
greedy accuracy of the result, and writes `results/<timestamp>/dpo_arithmetic.json` with both
accuracies and the held-out preference metrics before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import time

from experiments.benchmarks.run import results_dir
from hybridjax.data.arithmetic_pairs import write_pairs
from hybridjax.offline.dpo import run_dpo

ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = ROOT / "hybridjax" / "assets" / "quickstart"
VAL_KEY = "val-core/arithmetic/acc/mean@1"


def load_config_file(name: str):
    """`configs/<name>.py`'s `get_config()`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def greedy_accuracy(model_path: str, work_dir: str) -> float:
    """Greedy accuracy of the HF checkpoint `model_path` on the quick start's 256 held-out
    problems: the RL trainer's validation (`val-core/arithmetic/acc/mean@1`)."""
    from hybridjax.rl.trainer import RLTrainer

    c = load_config_file("quickstart")
    c.actor_rollout_ref.model.path = model_path
    c.trainer.default_local_dir = work_dir
    c.trainer.logger = ()
    trainer = RLTrainer(c)
    try:
        return trainer.validate()[VAL_KEY]
    finally:
        trainer.close()


def run(steps: int, lr: float, lora_rank: int, out: pathlib.Path) -> dict:
    pairs = write_pairs(str(ASSETS / "data"), str(out / "pairs"))
    c = load_config_file("dpo_arithmetic")
    c.data.train_files, c.data.val_files = pairs["train"], pairs["test"]
    c.optim.lr = lr
    c.model.lora_rank = lora_rank
    c.trainer.total_training_steps = steps
    c.trainer.test_freq = steps
    c.trainer.val_before_train = True
    c.trainer.default_local_dir = str(out / "dpo")
    c.trainer.resume_mode = "disable"
    c.trainer.logger = ("jsonl",)
    before = greedy_accuracy(str(ASSETS / "sft_model"), str(out / "val_before"))
    tic = time.perf_counter()
    run_dpo(c)
    seconds = time.perf_counter() - tic
    after = greedy_accuracy(str(out / "dpo" / "hf"), str(out / "val_after"))
    records = [json.loads(line) for line in open(out / "dpo" / "logs" / "metrics.jsonl")]
    evals = {r["step"]: r for r in records if "eval_loss" in r}
    keys = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/accuracies")
    return {
        "steps": steps,
        "lr": lr,
        "lora_rank": lora_rank,
        "dpo_wall_s": round(seconds, 1),
        "greedy_accuracy": {"before": before, "after": after},
        "held_out": {step: {k: r[k] for k in keys} for step, r in sorted(evals.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora_rank", type=int, default=0)
    parser.add_argument("--results", default="results")
    args = parser.parse_args()
    out = results_dir(args.results)
    summary = run(args.steps, args.lr, args.lora_rank, out)
    (out / "dpo_arithmetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written to {os.path.join(out, 'dpo_arithmetic.json')}")


if __name__ == "__main__":
    main()
