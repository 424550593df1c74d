"""Preference pairs for DPO from the arithmetic task (TRL's `prompt` / `chosen` / `rejected`).

    python -m hybridjax.data.arithmetic_pairs --input hybridjax/assets/quickstart/data \
        --output data/arithmetic_pairs [--train_size 2048] [--seed 0]

For each problem of the task's `train.parquet` / `test.parquet` (see `hybridjax.data.arithmetic`):
`chosen` is the answer in the rewarded form, `#### n`; `rejected` is, with probability 1/2, the
same number in the unrewarded form the quick start's warm start prefers (`Answer: n`), else a
wrong number in the rewarded form (`#### m`, m = n ± 1..3, m ≥ 0). So DPO from that warm start
has to learn the format without unlearning the arithmetic. The prompt is the task's message list
(the chat template is applied at load time). Seeded: the same command writes the same rows.
"""

from __future__ import annotations

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def rejected_answer(answer: int, rng: random.Random) -> str:
    """`Answer: n` or `#### m` with a wrong m (see the module docstring)."""
    if rng.random() < 0.5:
        return f"Answer: {answer}"
    wrong = answer + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if answer + d >= 0])
    return f"#### {wrong}"


def pair_rows(table: pa.Table, rng: random.Random, limit: int | None = None) -> pa.Table:
    """(prompt, chosen, rejected, operation) rows of a verl-schema arithmetic table."""
    rows = table.to_pylist()[:limit]
    answers = [int(r["reward_model"]["ground_truth"]) for r in rows]
    return pa.table(
        {
            "prompt": pa.array([r["prompt"] for r in rows], MESSAGES),
            "chosen": [f"#### {a}" for a in answers],
            "rejected": [rejected_answer(a, rng) for a in answers],
            "operation": [r["extra_info"]["operation"] for r in rows],
        }
    )


def write_pairs(input_dir: str, output_dir: str, train_size: int = 2048, seed: int = 0):
    """Writes `train.parquet` (the first `train_size` training problems) and `test.parquet`
    (every held-out problem); returns their paths."""
    rng = random.Random(seed)
    os.makedirs(output_dir, exist_ok=True)
    paths = {}
    for split, limit in (("train", train_size), ("test", None)):
        table = pq.read_table(os.path.join(input_dir, f"{split}.parquet"))
        paths[split] = os.path.join(output_dir, f"{split}.parquet")
        pq.write_table(pair_rows(table, rng, limit), paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="directory with train/test.parquet")
    parser.add_argument("--output", required=True)
    parser.add_argument("--train_size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in write_pairs(args.input, args.output, args.train_size, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
