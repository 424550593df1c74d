"""Synthetic arithmetic word problems: the quick start's task.

    python -m hybridjax.data.arithmetic --output data/arithmetic [--seed 0] [--train_size N]

writes three files (seeded, so the same command always writes the same rows):

* `train.parquet`, `test.parquet`: verl-schema prompts (`data_source="arithmetic"`, ground truth
  the integer answer, scored by the GSM8K strict reward: the number after the last `####`). No
  question of the held-out test split appears in the training split.
* `sft.parquet`: the training prompts with a `response` column written by a *sloppy teacher*:
  the arithmetic is always right, but the teacher ends with GSM8K's `#### n` only for a share of
  the problems (`format_p`, per operation) and otherwise writes `Answer: n`, which the strict
  reward scores 0. A model fine-tuned on it computes well but, greedily decoded, prefers the
  unrewarded form where the teacher mostly used it: reinforcement learning with the strict reward
  has a clear, fast signal to climb (the same kind of gain as verl's GSM8K quick start, where the
  score first rises as the model learns the answer format).

Problems (`a`, `b` drawn uniformly, `max_operand` bounds + and −, `max_factor` the first factor
of ×, the second a digit 2-9; subtraction never goes below zero):
    "She has 34 apples and gets 27 more. How many apples now?"            → 61
    "He has 52 cards and sells 18. How many cards are left?"              → 34
    "She buys 7 bags with 6 eggs each. How many eggs in total?"           → 42
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from hybridjax.data.schema import table_from_rows

DATA_SOURCE = "arithmetic"
OPERATIONS = ("+", "-", "*")
# One token each in the shipped GSM8K BPE, so the numbers sit at (nearly) fixed positions.
NAMES = ("She", "He")
ITEMS = ("apples", "books", "cards", "eggs", "cookies", "marbles", "pencils", "cups")
TEMPLATES = {
    "+": "{name} has {a} {item} and gets {b} more. How many {item} now?",
    "-": "{name} has {a} {item} and sells {b}. How many {item} are left?",
    "*": "{name} buys {a} bags with {b} {item} each. How many {item} in total?",
}
EXTRA_INFO_TYPE = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("operation", pa.string())]
)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What the generator draws. `format_p[op]` is the chance the SFT teacher ends with `#### n`.

    Raises (at construction): ValueError for an unknown operation or a bound below 1.
    """

    operations: tuple[str, ...] = OPERATIONS
    max_operand: int = 20
    max_factor: int = 9
    format_p: tuple[tuple[str, float], ...] = (("+", 0.9), ("-", 0.3), ("*", 0.3))

    def __post_init__(self):
        unknown = sorted(set(self.operations) - set(OPERATIONS))
        if unknown:
            raise ValueError(f"unknown operations {unknown}; known: {list(OPERATIONS)}")
        if self.max_operand < 1 or self.max_factor < 2:
            raise ValueError("max_operand must be >= 1 and max_factor >= 2")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: `question` text, integer `answer`, and what it was made of."""

    operation: str
    a: int
    b: int
    question: str
    answer: int


def make_problem(rng: random.Random, task: TaskConfig) -> Problem:
    """Draws one word problem (operation uniform over `task.operations`)."""
    op = rng.choice(task.operations)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if op == "*":
        a, b = rng.randint(2, task.max_factor), rng.randint(2, 9)
        answer = a * b
    else:
        a, b = rng.randint(0, task.max_operand), rng.randint(0, task.max_operand)
        if op == "-":
            a, b = max(a, b), min(a, b)
        answer = a + b if op == "+" else a - b
    question = TEMPLATES[op].format(name=name, item=item, a=a, b=b)
    return Problem(op, a, b, question, answer)


def teacher_response(problem: Problem, rng: random.Random, task: TaskConfig) -> str:
    """The sloppy teacher: `#### n` with probability `format_p[op]`, else `Answer: n`."""
    if rng.random() < dict(task.format_p)[problem.operation]:
        return f"#### {problem.answer}"
    return f"Answer: {problem.answer}"


class _Drawn(Protocol):  # what `split_drawn` reads of a problem
    @property
    def question(self) -> str: ...


DrawnT = TypeVar("DrawnT", bound=_Drawn)
TaskT = TypeVar("TaskT")


def split_problems(
    seed: int, train_size: int, test_size: int, task: TaskConfig
) -> tuple[list[Problem], list[Problem]]:
    """(train, test) of `task`'s problems (`split_drawn` with `make_problem`).

    Raises:
      ValueError: the task has too few distinct problems for `test_size`.
    """
    return split_drawn(seed, train_size, test_size, task, make_problem)


def split_drawn(
    seed: int,
    train_size: int,
    test_size: int,
    task: TaskT,
    draw: Callable[[random.Random, TaskT], DrawnT],
) -> tuple[list[DrawnT], list[DrawnT]]:
    """(train, test): the test problems first, then training problems whose question text is
    not a test question. Deterministic in `seed`. (The operands of a held-out question may
    appear in training in other words: the small task has few distinct `(op, a, b)`.)
    `draw(rng, task)` makes one problem (another task's generator may be passed).

    Raises:
      ValueError: the task has too few distinct problems for `test_size`.
    """
    rng = random.Random(seed)
    test: list[DrawnT] = []
    seen: set[str] = set()
    for _ in range(50 * test_size):
        if len(test) == test_size:
            break
        problem = draw(rng, task)
        if problem.question not in seen:
            seen.add(problem.question)
            test.append(problem)
    if len(test) < test_size:
        raise ValueError(f"could not draw {test_size} distinct test problems; widen the task")
    train: list[DrawnT] = []
    while len(train) < train_size:
        problem = draw(rng, task)
        if problem.question not in seen:
            train.append(problem)
    return train, test


def to_row(problem: Problem, split: str, index: int) -> dict:
    """One verl-schema row."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "operation": problem.operation},
    }


def write_task(
    output_dir: str,
    seed: int = 0,
    train_size: int = 20_000,
    test_size: int = 256,
    task: TaskConfig = TaskConfig(),
) -> dict[str, str]:
    """Writes `train.parquet`, `test.parquet` and `sft.parquet` (see the module docstring);
    returns their paths by name."""
    train, test = split_problems(seed, train_size, test_size, task)
    teacher_rng = random.Random(seed + 1)
    responses = [teacher_response(p, teacher_rng, task) for p in train]
    return write_tables(output_dir, train, test, to_row, EXTRA_INFO_TYPE, responses, pa.string())


def write_tables(
    output_dir: str,
    train: list,
    test: list,
    to_row: Callable[[Any, str, int], dict],
    extra_info_type: pa.DataType,
    responses: list,
    response_type: pa.DataType,
) -> dict[str, str]:
    """Writes `train.parquet` and `test.parquet` (one prompt row per problem,
    `to_row(problem, split, index)`) and `sft.parquet` (the train rows with a `response`
    column of `response_type`, one per train problem) into `output_dir`; returns their paths
    by name."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {name: os.path.join(output_dir, f"{name}.parquet") for name in ("train", "test", "sft")}
    tables = {
        split: table_from_rows(
            [to_row(p, split, i) for i, p in enumerate(problems)], extra_info_type
        )
        for split, problems in (("train", train), ("test", test))
    }
    for split, table in tables.items():
        pq.write_table(table, paths[split])
    sft = tables["train"].append_column("response", pa.array(responses, response_type))
    pq.write_table(sft, paths["sft"])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory of the three parquet files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train_size", type=int, default=20_000)
    parser.add_argument("--test_size", type=int, default=256)
    parser.add_argument("--max_operand", type=int, default=TaskConfig.max_operand)
    parser.add_argument("--max_factor", type=int, default=TaskConfig.max_factor)
    args = parser.parse_args(argv)
    task = TaskConfig(max_operand=args.max_operand, max_factor=args.max_factor)
    paths = write_task(args.output, args.seed, args.train_size, args.test_size, task)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
