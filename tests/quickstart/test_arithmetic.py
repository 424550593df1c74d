"""The arithmetic task generator: seeded, held out, right answers, the teacher's formats."""

import collections
import random
import re

import pyarrow.parquet as pq
import pytest

from hybridjax.data.arithmetic import (
    DATA_SOURCE,
    TaskConfig,
    make_problem,
    split_problems,
    teacher_response,
    write_task,
)
from hybridjax.data.schema import read_table
from hybridjax.rewards import default_compute_score


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    return write_task(str(out), seed=3, train_size=600, test_size=40)


def test_problem_texts_and_answers():
    rng = random.Random(0)
    task = TaskConfig()
    for _ in range(300):
        p = make_problem(rng, task)
        assert re.findall(r"\d+", p.question) == [str(p.a), str(p.b)]
        expected = {"+": p.a + p.b, "-": p.a - p.b, "*": p.a * p.b}[p.operation]
        assert p.answer == expected and p.answer >= 0
        if p.operation == "*":
            assert 2 <= p.a <= task.max_factor and 2 <= p.b <= 9
        elif p.operation == "-":
            assert 0 <= p.b <= p.a <= task.max_operand
        else:
            assert 0 <= min(p.a, p.b) and max(p.a, p.b) <= task.max_operand


def test_split_is_seeded_and_held_out():
    task = TaskConfig()
    train, test = split_problems(7, 500, 50, task)
    again_train, again_test = split_problems(7, 500, 50, task)
    assert train == again_train and test == again_test
    assert split_problems(8, 500, 50, task)[1] != test
    test_questions = {p.question for p in test}
    assert len(test_questions) == 50  # distinct
    assert not test_questions & {p.question for p in train}


def test_teacher_formats_follow_format_p():
    task = TaskConfig(format_p=(("+", 1.0), ("-", 0.0), ("*", 0.25)))
    rng = random.Random(1)
    counts = collections.Counter()
    for _ in range(2000):
        p = make_problem(rng, task)
        r = teacher_response(p, rng, task)
        assert r in (f"#### {p.answer}", f"Answer: {p.answer}")
        counts[p.operation, r.startswith("####")] += 1
    assert counts["+", False] == 0 and counts["-", True] == 0
    share = counts["*", True] / (counts["*", True] + counts["*", False])
    assert 0.2 < share < 0.3


def test_written_files_are_verl_schema_and_scored_by_gsm8k_strict(written):
    for name in ("train", "test", "sft"):
        table = read_table(written[name])
        assert table.column("data_source").to_pylist()[0] == DATA_SOURCE
    sft = pq.read_table(written["sft"]).to_pylist()
    train = pq.read_table(written["train"]).to_pylist()
    assert len(sft) == len(train) == 600
    assert len(pq.read_table(written["test"])) == 40
    row = sft[0]
    assert row["prompt"] == train[0]["prompt"]
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(DATA_SOURCE, f"#### {truth}", truth) == 1.0
    assert default_compute_score(DATA_SOURCE, f"Answer: {truth}", truth) == 0.0
    expected = 1.0 if row["response"].startswith("####") else 0.0
    assert default_compute_score(DATA_SOURCE, row["response"], truth) == expected


def test_same_seed_same_bytes(tmp_path, written):
    again = write_task(str(tmp_path), seed=3, train_size=600, test_size=40)
    for name in ("train", "test", "sft"):
        assert pq.read_table(again[name]).equals(pq.read_table(written[name]))


def test_bad_task_raises():
    with pytest.raises(ValueError, match="unknown operations"):
        TaskConfig(operations=("/",))
    with pytest.raises(ValueError, match="distinct test problems"):
        split_problems(0, 10, 500, TaskConfig(operations=("*",), max_factor=2))
