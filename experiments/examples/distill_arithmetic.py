"""On-policy distillation against GRPO from the same student, measured end to end on the CPU:

    python -m experiments.examples.distill_arithmetic [--teacher_steps 15] \
        [--student_sft_steps 300] [--steps 20] [--lr 1e-4] [--seed 0] \
        [--teacher DIR] [--student DIR] [--topk K]

1. The teacher: the quick start's warm start (4 layers, width 256, 3.4M parameters) trained
   with the quick start's GRPO (`configs/quickstart.py`) for `--teacher_steps` steps, written
   as an HF checkpoint.
2. The student: a model half as wide and half as deep (2 layers, width 128; `STUDENT`),
   fine-tuned with `configs/sft_arithmetic.py` on the task's sloppy SFT answers
   (`hybridjax.data.arithmetic`, the quick start's problems) for `--student_sft_steps` steps.
3. From that student, the same number of RL steps (`--steps`, the same lr, batch, `rollout.n`
   and prompts) of (a) on-policy distillation from the teacher (`configs/quickstart_distill.py`'s
   keys: `distillation.loss_mode` reward, no task advantage; the teacher on the reference's
   pool) and (b) GRPO on the strict reward (`configs/quickstart.py`), both with
   `trainer.seed` = `--seed` (the sampling). `--teacher` / `--student` reuse the checkpoints of
   an earlier run (`<results>/teacher/hf`, `<results>/student/model`) instead of steps 1 / 2.
   `--topk K` adds (c): the same distillation run with the `forward_kl_topk` loss over the
   teacher's K most likely tokens (`distillation.topk`).

Accuracy is the quick start's validation: greedy decoding of the 256 held-out problems scored by
GSM8K's strict `#### n` rule (`val-core/arithmetic/acc/mean@1`). Writes
`results/<timestamp>/distill_arithmetic.json`: the teacher's accuracy, the student's before, and
after each run, with wall times and the first / last training metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

from experiments.benchmarks.run import results_dir
from experiments.examples.dpo_arithmetic import VAL_KEY, load_config_file

# The student: half the teacher's width and depth (a fourth of its non-embedding layers' width
# × depth), the teacher's tokenizer and head layout (4 heads of 32).
STUDENT = dict(
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    attention_bias=True,
    tie_word_embeddings=True,
)
CURVE_KEYS = ("critic/score/mean", "distill/reverse_kl", "response_length/mean")


def rl_run(c, out: pathlib.Path, export: str = "") -> dict:
    """Trains `c` (an RL config) with validation off, then validates once; with `export`,
    writes the trained actor there as an HF checkpoint. Returns accuracy, wall time, curve."""
    from flax import nnx

    from hybridjax.checkpointing.export import write_hf_export
    from hybridjax.rl.trainer import RLTrainer

    c.trainer.val_before_train = False
    c.trainer.test_freq = -1
    c.trainer.save_freq = -1
    c.trainer.default_local_dir = str(out)
    c.trainer.logger = ("jsonl",)
    trainer = RLTrainer(c)
    try:
        tic = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - tic
        accuracy = trainer.validate()[VAL_KEY]
        if export:
            model = nnx.merge(trainer.actor_graphdef, trainer.actor_state.params)
            write_hf_export(model, trainer.tokenizer, export)
    finally:
        trainer.close()
    records = [json.loads(line) for line in open(out / "logs" / "metrics.jsonl")]
    steps = [r for r in records if "critic/score/mean" in r]
    curve = {
        f"step_{r['step']}": {k: round(r[k], 4) for k in CURVE_KEYS if k in r}
        for r in (steps[0], steps[-1])
    }
    return {"accuracy": accuracy, "wall_s": round(wall, 1), "training": curve}


def greedy_accuracy(model_path: str, work_dir: pathlib.Path) -> float:
    """Greedy held-out accuracy of the HF checkpoint `model_path` (the quick start's
    validation)."""
    from hybridjax.rl.trainer import RLTrainer

    c = load_config_file("quickstart")
    c.actor_rollout_ref.model.path = model_path
    c.trainer.default_local_dir = str(work_dir)
    c.trainer.logger = ()
    trainer = RLTrainer(c)
    try:
        return trainer.validate()[VAL_KEY]
    finally:
        trainer.close()


def train_student(sft_steps: int, out: pathlib.Path) -> tuple[str, dict]:
    """(path, summary) of the student: `STUDENT` fine-tuned on the sloppy SFT answers."""
    from hybridjax.data.arithmetic import write_task
    from hybridjax.offline.sft import run_sft

    data = write_task(str(out / "data"))  # the quick start's problems (seed 0)
    c = load_config_file("sft_arithmetic")
    c.data.train_files = data["sft"]
    c.model.override_config = STUDENT
    c.optim.lr = 1e-3
    c.trainer.total_training_steps = sft_steps
    c.trainer.save_freq = -1
    c.trainer.default_local_dir = str(out / "checkpoints")
    c.trainer.output_dir = path = str(out / "model")
    c.trainer.logger = ("jsonl",)
    tic = time.perf_counter()
    metrics = run_sft(c)
    summary = {
        "model": STUDENT,
        "sft_steps": sft_steps,
        "final_loss": round(float(metrics["train/loss"]), 4),
        "wall_s": round(time.perf_counter() - tic, 1),
    }
    return path, summary


def rl_config(student: str, steps: int, lr: float, seed: int, teacher: str = "", topk: int = 0):
    """The quick start's GRPO config on `student`; with `teacher`, pure on-policy distillation
    from it instead (`configs/quickstart_distill.py`'s distillation keys; with `topk`, the
    `forward_kl_topk` loss over the teacher's `topk` best tokens)."""
    c = load_config_file("quickstart")
    a = c.actor_rollout_ref
    a.model.path = student
    a.actor.optim.lr = lr
    c.trainer.total_training_steps = steps
    c.trainer.seed = seed
    if teacher:
        distill = load_config_file("quickstart_distill").actor_rollout_ref.distillation
        a.distillation.update(distill.to_dict())
        a.distillation.teacher_model.path = teacher
        if topk:
            a.distillation.loss_mode, a.distillation.topk = "forward_kl_topk", topk
    return c


def run(args: argparse.Namespace, out: pathlib.Path) -> dict:
    tic = time.perf_counter()
    summary: dict = {}
    if args.teacher:
        teacher = args.teacher
        summary["teacher"] = {"path": teacher}
        summary["teacher"]["accuracy"] = greedy_accuracy(teacher, out / "teacher_val")
    else:
        teacher = str(out / "teacher" / "hf")
        teacher_cfg = load_config_file("quickstart")
        teacher_cfg.trainer.total_training_steps = args.teacher_steps
        summary["teacher"] = rl_run(teacher_cfg, out / "teacher", export=teacher)
        summary["teacher"]["grpo_steps"] = args.teacher_steps
    if args.student:
        student, summary["student"] = args.student, {"path": args.student}
    else:
        student, summary["student"] = train_student(args.student_sft_steps, out / "student")
    print("teacher:", json.dumps(summary["teacher"]), flush=True)
    summary["student"]["accuracy"] = greedy_accuracy(student, out / "student" / "val")
    print("student:", json.dumps(summary["student"]), flush=True)
    summary["rl"] = {"steps": args.steps, "lr": args.lr, "seed": args.seed}
    runs = [("distillation", teacher, 0), ("grpo", "", 0)]
    runs += [(f"distillation_top{args.topk}", teacher, args.topk)] if args.topk else []
    for name, teacher_path, topk in runs:
        c = rl_config(student, args.steps, args.lr, args.seed, teacher_path, topk)
        summary[name] = rl_run(c, out / name)
        print(f"{name}:", json.dumps(summary[name]), flush=True)
    summary["wall_s"] = round(time.perf_counter() - tic, 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher_steps", type=int, default=15, help="the teacher's GRPO steps")
    parser.add_argument("--student_sft_steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each student run")
    parser.add_argument("--lr", type=float, default=1e-4, help="the student runs' actor lr")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed of the student runs")
    parser.add_argument("--teacher", default="", help="a trained teacher (HF dir): skips step 1")
    parser.add_argument("--student", default="", help="a student (HF dir): skips step 2")
    parser.add_argument("--topk", type=int, default=0, help="also distil with forward_kl_topk")
    parser.add_argument("--results", default="results")
    args = parser.parse_args()
    out = results_dir(args.results)
    summary = run(args, out)
    (out / "distill_arithmetic.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"written to {os.path.join(out, 'distill_arithmetic.json')}")


if __name__ == "__main__":
    main()
