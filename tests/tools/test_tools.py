"""Tools: the calculator, the Hermes parser, the executor's error handling, the Python sandbox,
verl's tool config file and the chat rendering of tool responses."""

import os
import time

import pytest
from tool_fixtures import Failing, Long, Slow

from hybridjax import process_tree
from hybridjax.models.tokenizer import Tokenizer
from hybridjax.tools import ParseError, ToolCall, ToolExecutor, get_parser, load_tools
from hybridjax.tools.calculator import CalculatorTool, evaluate
from hybridjax.tools.chat import ChatTools
from hybridjax.tools.executor import truncate
from hybridjax.tools.sandbox import PythonTool, run_python

TOKENIZER = "hybridjax/assets/tokenizers/gsm8k_bpe"


@pytest.mark.parametrize(
    "expr, value",
    [
        ("1 + 2 * 3", 7),
        ("(12 + 30) * 1.5", 63.0),
        ("-2 ** 3", -8),
        ("7 // 2 + 7 % 2", 4),
        ("sqrt(16) + abs(-1)", 5.0),
        ("round(2.567, 1)", 2.6),
        ("10 / 4", 2.5),
    ],
)
def test_calculator_values(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os')", "unsupported"),
        ("x + 1", "unsupported"),
        ("(1).real", "unsupported"),
        ("2 ** 1000", "exponent"),
        ("10.0 ** 99 * 10.0 ** 99", "out of range"),
        ("1 +", "not an"),
        ("1" * 300, "longer"),
        ("open('f')", "unsupported"),
        ("round(10**100, -10**18)", "round argument 2"),  # holds the GIL for hours if run
        ("round(1, 10**6)", "round argument 2"),
        ("(10**100) ** 100", "out of range"),
        ("99 ** 99 ** 2", "exponent"),
    ],
)
def test_calculator_rejects(expr, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expr)


def test_a_call_holding_the_gil_is_killed_at_its_deadline():
    from tool_fixtures import BigPower

    ex = ToolExecutor([BigPower(), CalculatorTool()], timeout_s=2.0)
    start = time.monotonic()
    slow, quick = ex.run([ToolCall("big_power", {}), ToolCall("calculator", {"expression": "1+1"})])
    assert time.monotonic() - start < 6
    assert "timed out after 2.0 s" in slow.text and quick.text == "2"
    assert ex.run([ToolCall("calculator", {"expression": "2*3"})])[0].text == "6"  # replaced
    ex.close()


def test_calculator_tool_formats_numbers():
    tool = CalculatorTool()
    assert tool.execute({"expression": "3 * 4.0"}) == "12"
    assert tool.execute({"expression": "1 / 3"}) == "0.3333333333"
    with pytest.raises(ValueError, match="expression"):
        tool.execute({})


def test_hermes_parser():
    parse = get_parser("hermes")
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        '</tool_call> and <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("f", {"a": 1})]
    assert isinstance(calls[2], ParseError) and "invalid JSON" in calls[2].reason
    assert isinstance(calls[3], ParseError) and "'name'" in calls[3].reason
    assert parse("no calls here") == []
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_executor_turns_every_failure_into_a_message():
    ex = ToolExecutor(
        [CalculatorTool(), Slow(), Failing(), Long()], timeout_s=2.0, max_response_length=80
    )
    calls = [
        ToolCall("calculator", {"expression": "6*7"}),
        ToolCall("slow", {"s": 20.0}),
        ToolCall("fail", {}),
        ParseError("{x", "invalid JSON: ..."),
        ToolCall("search", {}),
        ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("long", {}),
    ]
    start = time.monotonic()
    results = ex.run(calls)
    assert time.monotonic() - start < 6  # one deadline for all calls, run concurrently
    assert results[0].text == "42" and not results[0].error
    assert "timed out after 2.0 s" in results[1].text and results[1].error
    assert results[2].text == "Error: KeyError: 'boom'" and results[2].error
    assert "malformed tool call" in results[3].text
    assert "unknown tool 'search'" in results[4].text and "calculator" in results[4].text
    assert "ZeroDivisionError" in results[5].text
    assert len(results[6].text) == 80 + len("...(truncated)...")  # too long: cut in the middle
    assert all(r.error for r in results[1:6]) and not results[6].error
    ex.close()


def test_truncate_sides():
    assert truncate("abcdef", 4, "right") == "abcd...(truncated)"
    assert truncate("abcdef", 4, "left") == "...(truncated)cdef"
    assert truncate("abcdef", 4, "middle") == "ab...(truncated)...ef"
    assert truncate("abc", 4) == "abc"
    with pytest.raises(ValueError, match="truncate_side"):
        ToolExecutor([], truncate_side="top")


def test_python_sandbox_limits():
    assert run_python("print(sum(range(10)))")[1] == "45\n"
    with pytest.raises(TimeoutError):
        run_python("while True: pass", timeout_s=1.0)
    rc, _, err = run_python("x = bytearray(512 << 20)", memory_mb=128)
    assert rc != 0 and "MemoryError" in err
    rc, _, err = run_python("import socket; socket.create_connection(('1.1.1.1', 80))")
    assert rc != 0 and "Network is unreachable" in err
    rc, out, _ = run_python("import os; print(os.getcwd() != '/')")
    assert out == "True\n"
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        PythonTool().execute({"code": "1/0"})


@pytest.mark.parametrize("under", ["/tmp", "/work"])
def test_the_sandbox_finds_an_interpreter_under_its_private_dirs(under, monkeypatch):
    """A virtualenv under /tmp or /work (a CI checkout, a notebook's scratch dir) stays visible
    over the sandbox's private /tmp and /work (its prefix is mounted after them)."""
    import os
    import shutil
    import sys
    import tempfile

    try:
        os.makedirs(under, exist_ok=True)
        prefix = tempfile.mkdtemp(prefix="venv-", dir=under)
    except OSError as e:  # not root: /work may not exist or be writable
        pytest.skip(f"cannot make a directory under {under}: {e}")
    try:
        os.makedirs(f"{prefix}/bin")
        os.symlink(os.path.realpath(sys.executable), f"{prefix}/bin/python")
        monkeypatch.setattr(sys, "prefix", prefix)
        monkeypatch.setattr(sys, "executable", f"{prefix}/bin/python")
        rc, out, err = run_python("print(6 * 7)")
        assert (rc, out) == (0, "42\n"), err
    finally:
        shutil.rmtree(prefix)


def test_tool_config_file(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: calculator\n"
        "    config: {type: native}\n"
        "  - class_name: hybridjax.tools.sandbox.PythonTool\n"
        "    config: {timeout_s: 2}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: run_code, description: runs code, parameters: {type: object}}\n"
    )
    calc, py = load_tools(path)
    assert calc.name == "calculator" and py.name == "run_code" and py.config["timeout_s"] == 2
    path.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n")
    with pytest.raises(ValueError, match=r"tools\[0\]: class_name 'verl.tools"):
        load_tools(path)
    path.write_text("tools:\n  - class_name: calculator\n    schema: {}\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_tools(path)
    path.write_text("tool: []\n")
    with pytest.raises(ValueError, match="'tools' list"):
        load_tools(path)


def test_chat_rendering_is_token_in_token_out():
    tok = Tokenizer.from_pretrained(TOKENIZER)
    tools = ChatTools(tok, ToolExecutor([CalculatorTool()]))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 6*7?"}])
    turn = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}')
    turn += tok.encode("</tool_call>") + [tok.eos_token_id]
    calls = tools.parse(turn)
    assert calls == [ToolCall("calculator", {"expression": "6*7"})]
    results = tools.execute(calls)
    appended = tools.render(calls, results)
    assert tools.render_text(results) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # the trajectory's text is the chat template's rendering of the whole conversation
    trajectory = tok.decode(prompt + turn + appended, skip_special_tokens=False)
    assistant = tok.decode(turn[:-1], skip_special_tokens=False)
    expect = tok.render_chat(
        [
            {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": assistant},
            {"role": "tool", "content": "42"},
        ]
    )
    assert trajectory == expect


def test_gsm8k_recipe_prompts_show_the_tool_and_its_config_loads():
    from hybridjax.data.gsm8k import to_row

    row = to_row("What is 2+3?", "2+3=5 #### 5", "train", 0, multi_turn=True)
    system, user = row["prompt"]
    assert system["role"] == "system" and '"name": "calculator"' in system["content"]
    assert "<tool_call>" in system["content"] and user["content"].startswith("What is 2+3?")
    assert to_row("q", "#### 1", "train", 0)["prompt"][0]["role"] == "user"
    (calc,) = load_tools("configs/tools/calculator.yaml")
    assert calc.name == "calculator" and calc.execute({"expression": "2+3"}) == "5"


CLOSED_AT_ONCE = """
from hybridjax.tools.calculator import CalculatorTool
from hybridjax.tools.executor import ToolExecutor
if __name__ == "__main__":
    for _ in range(5):
        ToolExecutor([CalculatorTool()], max_workers=4).close()
    import time
    time.sleep(1)  # what a killed worker would print arrives by then
"""


@pytest.mark.slow
def test_an_executor_closed_at_once_prints_no_tracebacks(tmp_path):
    """Closing right after start-up (as the config check does) killed workers the forkserver
    was still starting; each printed a multiprocessing traceback (SemLock: no such file)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "closed_at_once.py"
    script.write_text(CLOSED_AT_ONCE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_daemon_a_tool_starts_does_not_outlive_the_executor():
    """As a reward function's (issue 48, K22): the tool's worker keeps the daemon in its tree
    and kills it when the executor stops it."""
    from tool_fixtures import Daemon

    executor = ToolExecutor([Daemon()], timeout_s=20.0, max_workers=1)
    (result,) = executor.run([ToolCall("daemon", {})])
    pid = int(result.text)
    assert os.path.exists(f"/proc/{pid}")
    executor.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and process_tree.running(pid):
        time.sleep(0.05)
    assert not process_tree.running(pid), f"daemon {pid} outlived the executor"
