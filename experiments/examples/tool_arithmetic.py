"""The calculator-tool demonstration, measured end to end on the CPU:

    python -m experiments.examples.tool_arithmetic [--sft_stages 1.0:0.0:500,0.3:0.3:60] \
        [--sft_from DIR | --warm_start DIR] [--steps 30] [--lr 5e-5]

writes the task (`hybridjax.data.arithmetic_tools`), fine-tunes a warm start in stages
(`python -m hybridjax.sft` with `configs/sft_arithmetic_tools.py`, from the quick start's model
or `--sft_from`; skipped with `--warm_start`): each stage `tool_p:sloppy_p:steps` trains on a
teacher with those rates (`ToolTaskConfig`), from the previous stage's model. The default
curriculum first teaches the call and reading its result (a teacher that always calls, never
sloppily), then makes calls occasional and sometimes malformed, so that GRPO has something to
learn. Then it samples the warm start at temperature 1 on 16 hard held-out problems
(`rollout.n` each: is there anything for GRPO to learn?), measures it greedily on the 256
held-out problems,
trains it with GRPO and the calculator (`configs/arithmetic_tools.py`, multi-turn rollouts;
`--steps 0` stops before), measures it again, and writes `results/<timestamp>/tool_arithmetic.json`
(each stage's model is in `results/<timestamp>/sft_<k>/model`).

Measured, per held-out split (easy: the quick start's problems; hard: 2-digit × 2-digit):
`accuracy` (GSM8K's strict reward), `tool_use` (share of problems with at least one call),
`right_call` (share with a call that ran and returned the right answer: correct tool use),
`answer_from_tool` (of those, the share answered with that result), `call_success` (share of
calls that parsed and ran without error); plus the training curve's `multi_turn/*` metrics and
reward at temperature 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import numpy as np

from experiments.benchmarks.run import results_dir
from experiments.examples.dpo_arithmetic import load_config_file
from hybridjax.data.arithmetic_tools import ToolTaskConfig, write_task
from hybridjax.offline.sft import run_sft
from hybridjax.rewards import decode_responses, default_compute_score
from hybridjax.rl.generation import generate_batch


def score(trainer, prompts: dict, sampling) -> list[tuple[bool, float, int, int, bool]]:
    """(hard, reward, calls, failed calls, right call) of each trajectory of a multi-turn
    rollout of `prompts` (prompt-major, `sampling.n` per prompt), scored with the task's reward;
    a right call ran and returned the ground truth."""
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
    rows = []
    for i in np.flatnonzero(host.row_mask):
        info = host.extra_info[i]
        reward = default_compute_score(host.data_source[i], texts[i], host.ground_truth[i])
        calls = info["tool_calls"]
        right = any(not c["error"] and c["response"].strip() == host.ground_truth[i] for c in calls)
        failed = sum(c["error"] for c in calls)
        rows.append((info["hard"], float(reward), len(calls), failed, right))
    return rows


def rates(rows: list[tuple[bool, float, int, int, bool]]) -> dict:
    """`accuracy`, `tool_use` (share with a call), `right_call` (share with a right call),
    `answer_from_tool` (of those, the share rewarded), `calls` and `call_success` of `score`
    rows (None where there is nothing to divide)."""
    calls = sum(r[2] for r in rows)
    right = [r[1] for r in rows if r[4]]
    share = lambda values: round(float(np.mean(values)), 4) if len(values) else None  # noqa: E731
    return {
        "problems": len(rows),
        "accuracy": share([r[1] for r in rows]),
        "tool_use": share([r[2] > 0 for r in rows]),
        "right_call": share([r[4] for r in rows]),
        "answer_from_tool": share(right),
        "calls": calls,
        "call_success": round(1 - sum(r[3] for r in rows) / calls, 4) if calls else None,
    }


def evaluate(trainer) -> dict:
    """Greedy (`rollout.val_kwargs`) multi-turn rollouts of the trainer's current weights on its
    validation files; `rates` per split ("easy", "hard", "all")."""
    sampling = trainer.sampling(trainer.global_step, validate=True)
    rows = [
        r for prompts in trainer.val_loader.iter_epoch() for r in score(trainer, prompts, sampling)
    ]
    return {
        split: rates([r for r in rows if keep is None or r[0] == keep])
        for split, keep in (("easy", False), ("hard", True), ("all", None))
    }


def sampled_hard(trainer, num_prompts: int = 16) -> dict:
    """The training rollout (`rollout.n` samples each, its temperature) of the first
    `num_prompts` hard held-out problems: `rates` per trajectory, and `groups_with_signal`, the
    share of problems whose samples do not all score the same (GRPO learns from those only)."""
    state = trainer.val_loader.get_state()
    prompts = next(trainer.val_loader)
    trainer.val_loader.set_state(state)
    hard = [i for i, info in enumerate(prompts["extra_info"]) if info["hard"]][:num_prompts]
    if len(hard) < num_prompts:
        raise ValueError(
            f"the first validation batch has {len(hard)} hard problems, not {num_prompts}"
        )
    take = lambda v: v[hard] if isinstance(v, np.ndarray) else [v[i] for i in hard]
    sampling = trainer.sampling(0, gen_batch=1)
    rows = score(trainer, {k: take(v) for k, v in prompts.items()}, sampling)
    groups = np.array([r[1] for r in rows]).reshape(num_prompts, sampling.n)
    return {
        "samples_each": sampling.n,
        "temperature": sampling.temperature,
        **rates(rows),
        "groups_with_signal": round(float(np.mean(groups.min(1) < groups.max(1))), 4),
    }


@dataclasses.dataclass(frozen=True)
class Stage:
    """One SFT stage of the warm start: the teacher's rates (`ToolTaskConfig`) and its steps."""

    tool_p: float
    sloppy_p: float
    steps: int


def parse_stages(text: str) -> list[Stage]:
    """`tool_p:sloppy_p:steps[,...]` as stages. Raises ValueError naming a bad stage."""
    stages = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            stage = Stage(float(fields[0]), float(fields[1]), int(fields[2]))
            ToolTaskConfig(tool_p=stage.tool_p, sloppy_p=stage.sloppy_p)
        except (ValueError, IndexError) as e:
            raise ValueError(f"--sft_stages: {part!r} is not tool_p:sloppy_p:steps ({e})") from None
        if len(fields) != 3 or stage.steps < 1:
            raise ValueError(f"--sft_stages: {part!r} is not tool_p:sloppy_p:steps (steps >= 1)")
        stages.append(stage)
    return stages


def warm_start(
    stages: list[Stage], out: pathlib.Path, init: str | None = None
) -> tuple[str, list[dict]]:
    """(path, one summary per stage) of the SFT warm start: each stage trains on its teacher
    from the previous stage's model (the first from `init`; None: the config's model, the
    quick start's warm start)."""
    model, summaries = init, []
    for k, stage in enumerate(stages, 1):
        task = ToolTaskConfig(tool_p=stage.tool_p, sloppy_p=stage.sloppy_p)
        data = write_task(str(out / f"sft_{k}" / "data"), task=task)
        c = load_config_file("sft_arithmetic_tools")
        if model is not None:
            c.model.path = model
        c.data.train_files = data["sft"]
        c.trainer.total_training_steps = stage.steps
        c.trainer.default_local_dir = str(out / f"sft_{k}" / "checkpoints")
        c.trainer.output_dir = model = str(out / f"sft_{k}" / "model")
        c.trainer.logger = ("jsonl",)
        tic = time.perf_counter()
        metrics = run_sft(c)
        summaries.append(
            {
                **dataclasses.asdict(stage),
                "final_loss": round(float(metrics["train/loss"]), 4),
                "wall_s": round(time.perf_counter() - tic, 1),
            }
        )
        print(f"SFT stage {k}:", json.dumps(summaries[-1]), flush=True)
    return model, summaries


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


def run(args: argparse.Namespace, out: pathlib.Path) -> dict:
    from hybridjax.rl.trainer import RLTrainer

    data = write_task(str(out / "data"))  # GRPO's prompts: the same problems for every teacher
    warm, stages = args.warm_start, []
    if warm is None:
        warm, stages = warm_start(parse_stages(args.sft_stages), out, args.sft_from)
    c = load_config_file("arithmetic_tools")
    c.data.train_files, c.data.val_files = data["train"], data["test"]
    c.actor_rollout_ref.model.path = warm
    c.actor_rollout_ref.actor.optim.lr = args.lr
    c.trainer.total_training_steps = max(args.steps, 1)
    c.trainer.val_before_train = False  # measured here, with the tool-use rates
    c.trainer.test_freq = -1
    c.trainer.default_local_dir = str(out / "grpo")
    c.trainer.logger = ("jsonl",)
    summary = {
        "sft_from": args.sft_from,
        "warm_start": args.warm_start,
        "sft_stages": stages,
        "grpo_steps": args.steps,
        "grpo_lr": args.lr,
    }
    trainer = RLTrainer(c)
    try:
        tic = time.perf_counter()
        summary["sampled_warm_start_hard"] = sampled_hard(trainer)
        summary["sampled_check_wall_s"] = round(time.perf_counter() - tic, 1)
        print("sampled:", json.dumps(summary["sampled_warm_start_hard"]), flush=True)
        before = evaluate(trainer)
        print("before:", json.dumps(before), flush=True)
        summary["greedy_held_out"] = {"before": before}
        if args.steps > 0:
            tic = time.perf_counter()
            trainer.fit()
            summary["grpo_wall_s"] = round(time.perf_counter() - tic, 1)
            summary["greedy_held_out"]["after"] = evaluate(trainer)
            print("after:", json.dumps(summary["greedy_held_out"]["after"]), flush=True)
    finally:
        trainer.close()
    if args.steps > 0:
        summary["training"] = curve(out / "grpo" / "logs" / "metrics.jsonl")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sft_stages",
        default="1.0:0.0:500,0.3:0.3:60",
        help="the warm start's SFT stages, tool_p:sloppy_p:steps each, comma-separated",
    )
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps (0: measure only)")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--warm_start", default=None, help="an SFT warm start (skips the SFT)")
    parser.add_argument("--sft_from", default=None, help="the SFT's initial model (a directory)")
    parser.add_argument("--results", default="results")
    args = parser.parse_args()
    out = results_dir(args.results)
    summary = run(args, out)
    (out / "tool_arithmetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written to {os.path.join(out, 'tool_arithmetic.json')}")


if __name__ == "__main__":
    main()
