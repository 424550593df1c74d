"""The calculator-tool task: held-out split, the teacher's calls and the calculator's real
responses, and SFT on trajectories laid out exactly as the multi-turn rollout builds them, with
the loss on assistant turns only."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from hybridjax.data.arithmetic_tools import ToolTaskConfig, write_task
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.offline.sft import read_rows, tokenize_pairs
from hybridjax.rewards import default_compute_score
from hybridjax.tools import ToolExecutor, get_parser
from hybridjax.tools.calculator import CalculatorTool
from hybridjax.tools.chat import ChatTools

TOKENIZER = "hybridjax/assets/tokenizers/gsm8k_bpe"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools")
    task = ToolTaskConfig(tool_p=0.4, sloppy_p=0.6)
    return write_task(str(out), seed=5, train_size=400, test_size=40, task=task)


def test_split_and_teacher(written):
    test = pq.read_table(written["test"]).to_pylist()
    sft = pq.read_table(written["sft"]).to_pylist()
    assert not {r["prompt"][0]["content"] for r in test} & {r["prompt"][0]["content"] for r in sft}
    parse = get_parser("hermes")
    kinds = {"direct": 0, "ok": 0, "sloppy": 0}
    for row in sft:
        info, messages = row["extra_info"], row["response"]
        answer = row["reward_model"]["ground_truth"]
        assert default_compute_score("arithmetic", messages[-1]["content"], answer) == 1.0
        a, op, b = info["expression"].split()
        assert int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert info["hard"] == (op == "*" and min(int(a), int(b)) >= 11)
        if len(messages) == 1:
            kinds["direct"] += 1
            continue
        assert info["hard"] and [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
        (call,) = parse(messages[0]["content"])
        assert call.name == "calculator"
        sloppy = "x" in call.arguments["expression"]
        kinds["sloppy" if sloppy else "ok"] += 1
        if sloppy:
            assert messages[1]["content"].startswith("Error: ValueError: not an arithmetic")
        else:
            assert messages[1]["content"] == answer
    # 400 rows, half hard; 40% of those call, 60% of the calls sloppily
    assert 40 < kinds["sloppy"] + kinds["ok"] < 120 and kinds["sloppy"] > kinds["ok"] > 10
    with pytest.raises(ValueError, match="tool_p"):
        ToolTaskConfig(tool_p=1.5)


def test_sft_trajectories_are_laid_out_as_the_rollout_builds_them(written):
    tok = Tokenizer.from_pretrained(TOKENIZER)
    rows = read_rows(written["sft"], "prompt", "response")
    plain = next(r for r in rows if isinstance(r[1], str))
    chosen = [r for r in rows if isinstance(r[1], tuple)][:3] + [plain]
    data = tokenize_pairs(chosen, tok, 192, "error")
    tools = ChatTools(tok, ToolExecutor([CalculatorTool()]))
    eos = tok.eos_token_id
    for i, (prompt, response) in enumerate(chosen[:3]):
        # what the agent loop appends: turn + EOS, the rendered tool response, answer + EOS
        call, _, answer = response
        turn = tok.encode(call[1]) + [eos]
        (parsed,) = tools.parse(turn)
        results = tools.execute([parsed])
        tool_ids = tools.render([parsed], results)
        final = tok.encode(answer[1]) + [eos]
        prompt_ids = tok.apply_chat_template(prompt)
        expect = prompt_ids + turn + tool_ids + final
        n = int(data["attention_mask"][i].sum())
        assert data["input_ids"][i, :n].tolist() == expect
        mask = [0] * len(prompt_ids) + [1] * len(turn) + [0] * len(tool_ids) + [1] * len(final)
        np.testing.assert_array_equal(data["loss_mask"][i, :n], mask)
        assert data["loss_mask"][i, n:].sum() == 0
    # a plain answer: the loss on the response and its EOS, as before
    assert data["loss_mask"][3].sum() == len(tok.encode(plain[1])) + 1


def test_sft_rejects_a_trajectory_that_ends_with_a_tool_message(tmp_path):
    path = tmp_path / "bad.jsonl"
    response = [{"role": "assistant", "content": "<tool_call>{}</tool_call>"}]
    response.append({"role": "tool", "content": "42"})
    path.write_text(json.dumps({"prompt": "q", "response": response}) + "\n")
    with pytest.raises(ValueError, match="row 0.*starts and ends with an assistant turn"):
        read_rows(str(path), "prompt", "response")
