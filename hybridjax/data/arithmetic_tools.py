"""Arithmetic word problems with a calculator tool: the multi-turn demonstration's task.

    python -m hybridjax.data.arithmetic_tools --output data/arithmetic_tools [--seed 0]

writes three files (seeded, so the same command always writes the same rows):

* `train.parquet`, `test.parquet`: verl-schema prompts (`data_source="arithmetic"`: GSM8K's
  strict reward, the number after the last `####`), half *easy* problems (the quick start's:
  + and − up to 20, × by a digit) and half *hard* ones, products of two 2-digit numbers
  ("She buys 37 bags with 24 eggs each. How many eggs in total?" → 888), which a 3.4M-parameter
  model cannot compute reliably. `extra_info.hard` says which. No test question is in training.
* `sft.parquet`: the training prompts with a `response` column of messages written by a teacher
  that answers the easy problems with `#### n` and, on a hard problem, calls the calculator with
  probability `tool_p` (in Hermes/Qwen form, `<tool_call>{"name": "calculator", "arguments":
  {"expression": "37 * 24"}}</tool_call>`), then answers from the tool's response; otherwise
  it answers directly (right, but a student cannot learn to be). Its calls are *sloppy*: with
  probability `sloppy_p` the expression is written `37 x 24`, which the calculator rejects; the
  teacher then answers directly. The tool messages are the calculator's real responses (through
  `hybridjax.tools.ToolExecutor`, errors included), and `hybridjax.sft` trains on the assistant
  turns only.

Copying the tool's 3- or 4-digit result into `#### n` is itself learned from the teacher's
successful calls, and takes a few hundred SFT steps of them: the demonstration
(`experiments/examples/tool_arithmetic.py`) first fine-tunes on a teacher that always calls and
never sloppily (`--tool_p 1 --sloppy_p 0`), then briefly on the defaults (`tool_p` 0.3,
`sloppy_p` 0.3), which leave calls occasional and sometimes malformed: room for GRPO.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import pyarrow as pa

from hybridjax.data import arithmetic
from hybridjax.data.arithmetic import DATA_SOURCE, ITEMS, NAMES, TEMPLATES, TaskConfig, make_problem
from hybridjax.tools import ToolCall, ToolExecutor
from hybridjax.tools.calculator import CalculatorTool

EXTRA_INFO_TYPE = pa.struct(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        ("operation", pa.string()),
        ("hard", pa.bool_()),
        ("expression", pa.string()),
    ]
)
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: its text, integer answer, the expression that computes it, and whether it
    is hard (a product of two 2-digit numbers)."""

    operation: str
    question: str
    answer: int
    expression: str
    hard: bool


@dataclasses.dataclass(frozen=True)
class ToolTaskConfig:
    """What the generator draws and how the teacher answers.

    hard_p: share of hard problems; min_hard, max_hard: bounds of both hard factors;
    tool_p: chance the teacher calls the calculator on a hard problem; sloppy_p: chance a
    call writes `a x b` (rejected by the calculator) instead of `a * b`.
    """

    hard_p: float = 0.5
    min_hard: int = 11
    max_hard: int = 99
    tool_p: float = 0.3
    sloppy_p: float = 0.3

    def __post_init__(self):
        for name in ("hard_p", "tool_p", "sloppy_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 2 <= self.min_hard <= self.max_hard:
            raise ValueError("need 2 <= min_hard <= max_hard")


EASY = TaskConfig()


def draw(rng: random.Random, task: ToolTaskConfig) -> Problem:
    """One problem: hard with probability `task.hard_p`, else one of the quick start's."""
    if rng.random() < task.hard_p:
        a, b = (rng.randint(task.min_hard, task.max_hard) for _ in range(2))
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        question = TEMPLATES["*"].format(name=name, item=item, a=a, b=b)
        return Problem("*", question, a * b, f"{a} * {b}", True)
    p = make_problem(rng, EASY)
    return Problem(p.operation, p.question, p.answer, f"{p.a} {p.operation} {p.b}", False)


def tool_call_text(expression: str) -> str:
    """The Hermes/Qwen call of the calculator (`hybridjax.tools.parser.parse_hermes`)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def teacher_messages(
    problem: Problem, rng: random.Random, task: ToolTaskConfig, executor: ToolExecutor
) -> list[dict[str, str]]:
    """The teacher's trajectory: [assistant] or [assistant call, tool response, assistant]."""
    answer = {"role": "assistant", "content": f"#### {problem.answer}"}
    if not problem.hard or rng.random() >= task.tool_p:
        return [answer]
    expression = problem.expression
    if rng.random() < task.sloppy_p:
        expression = expression.replace("*", "x")
    (result,) = executor.run([ToolCall("calculator", {"expression": expression})])
    call = {"role": "assistant", "content": tool_call_text(expression)}
    return [call, {"role": "tool", "content": result.text}, answer]


def split_problems(
    seed: int, train_size: int, test_size: int, task: ToolTaskConfig
) -> tuple[list[Problem], list[Problem]]:
    """(train, test), deterministic in `seed`: distinct test questions first, then training
    questions that are not test questions (`arithmetic.split_drawn` with this task's draw).

    Raises:
      ValueError: the task has too few distinct problems for `test_size`.
    """
    return arithmetic.split_drawn(seed, train_size, test_size, task, draw)


def to_row(problem: Problem, split: str, index: int) -> dict:
    """One verl-schema row."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "operation": problem.operation,
            "hard": problem.hard,
            "expression": problem.expression,
        },
    }


def write_task(
    output_dir: str,
    seed: int = 0,
    train_size: int = 20_000,
    test_size: int = 256,
    task: ToolTaskConfig = ToolTaskConfig(),
) -> dict[str, str]:
    """Writes `train.parquet`, `test.parquet` and `sft.parquet` (module docstring); returns
    their paths by name."""
    train, test = split_problems(seed, train_size, test_size, task)
    teacher_rng = random.Random(seed + 1)
    executor = ToolExecutor([CalculatorTool()], timeout_s=10.0, max_workers=1)
    try:
        responses = [teacher_messages(p, teacher_rng, task, executor) for p in train]
    finally:
        executor.close()
    return arithmetic.write_tables(
        output_dir, train, test, to_row, EXTRA_INFO_TYPE, responses, MESSAGES_TYPE
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory of the three parquet files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train_size", type=int, default=20_000)
    parser.add_argument("--test_size", type=int, default=256)
    parser.add_argument("--tool_p", type=float, default=ToolTaskConfig.tool_p)
    parser.add_argument("--sloppy_p", type=float, default=ToolTaskConfig.sloppy_p)
    args = parser.parse_args(argv)
    task = ToolTaskConfig(tool_p=args.tool_p, sloppy_p=args.sloppy_p)
    paths = write_task(args.output, args.seed, args.train_size, args.test_size, task)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
