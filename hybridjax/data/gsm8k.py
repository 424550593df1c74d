"""GSM8K (jsonl) → verl-schema parquet.

    python -m hybridjax.data.gsm8k --input /path/to/gsm8k --output data/gsm8k

reads `train.jsonl` and `test.jsonl` (each line `{"question", "answer"}`, the final answer after
`#### `) and writes `train.parquet` and `test.parquet` with verl's columns (see
`hybridjax.data.schema`), as verl's `examples/data_preprocess/gsm8k.py` does: the prompt is the
question plus an instruction to end with `#### <answer>`, the ground truth is the reference's final
answer with thousands separators removed.

`--multi-turn` writes the prompts of the calculator-tool recipe (`configs/gsm8k_multiturn.py`, as
verl's `gsm8k_multiturn_w_tool.py`): a system message shows the calculator's function schema and
the `<tool_call>{json}</tool_call>` format.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from hybridjax.data.schema import table_from_rows
from hybridjax.tools.calculator import CalculatorTool

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

TOOL_SYSTEM = (
    "You are a math expert. You may call this tool to compute arithmetic:\n<tools>\n{schema}\n"
    '</tools>\nTo call it, write <tool_call>{{"name": "calculator", "arguments": '
    '{{"expression": "..."}}}}</tool_call> and stop; its result comes back as a tool '
    "message."
)
EXTRA_INFO_TYPE = pa.struct(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        ("answer", pa.string()),
        ("question", pa.string()),
    ]
)


def extract_solution(answer: str) -> str:
    """The final answer of a GSM8K reference solution, without thousands separators.

    Raises:
      ValueError: the answer has no `#### <number>` line.
    """
    match = _ANSWER.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>': {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def to_row(question: str, answer: str, split: str, index: int, multi_turn: bool = False) -> dict:
    """One verl-schema row for a GSM8K problem (`multi_turn`: with the calculator's schema)."""
    prompt = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
    if multi_turn:
        schema = json.dumps(CalculatorTool.default_schema)
        prompt.insert(0, {"role": "system", "content": TOOL_SYSTEM.format(schema=schema)})
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_split(jsonl_path: str, parquet_path: str, split: str, multi_turn: bool = False) -> int:
    """Converts one jsonl file to a parquet file; returns the number of rows written.

    Raises:
      ValueError: a line is not JSON or lacks `question`/`answer` (names file and line).
    """
    rows: list[dict] = []
    with open(jsonl_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                rows.append(to_row(raw["question"], raw["answer"], split, len(rows), multi_turn))
            except (json.JSONDecodeError, KeyError, ValueError) as e:
                raise ValueError(f"{jsonl_path}, line {line_no}: {e!r}") from e
    pq.write_table(table_from_rows(rows, EXTRA_INFO_TYPE), parquet_path)
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="GSM8K jsonl -> verl-schema parquet")
    parser.add_argument("--input", required=True, help="directory with train.jsonl and test.jsonl")
    parser.add_argument("--output", required=True, help="directory for train/test.parquet")
    parser.add_argument(
        "--multi-turn", action="store_true", help="prompts of the calculator-tool recipe"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    for split in ("train", "test"):
        out = os.path.join(args.output, f"{split}.parquet")
        n = convert_split(os.path.join(args.input, f"{split}.jsonl"), out, split, args.multi_turn)
        print(f"wrote {out}: {n} rows")


if __name__ == "__main__":
    main()
