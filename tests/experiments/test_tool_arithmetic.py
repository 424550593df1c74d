"""The calculator-tool experiment's SFT curriculum parsing and its tool-use rates."""

import pytest

from experiments.examples.tool_arithmetic import Stage, parse_stages, rates


def test_parse_stages():
    assert parse_stages("1.0:0.0:500, 0.3:0.3:60") == [Stage(1.0, 0.0, 500), Stage(0.3, 0.3, 60)]
    for bad in ("1.5:0:10", "0.3:0.3", "a:0:1", "0.3:0.3:0", "0.3:0.3:5:1"):
        with pytest.raises(ValueError, match="--sft_stages"):
            parse_stages(f"1.0:0.0:5,{bad}")


def test_rates():
    # (hard, reward, calls, failed calls, right call)
    rows = [
        (True, 1.0, 1, 0, True),  # called, right result, answered with it
        (True, 0.0, 1, 0, True),  # called, right result, answered something else
        (True, 0.0, 2, 1, False),  # a rejected call, then a wrong one
        (True, 0.0, 0, 0, False),  # no call
    ]
    assert rates(rows) == {
        "problems": 4,
        "accuracy": 0.25,
        "tool_use": 0.75,
        "right_call": 0.5,
        "answer_from_tool": 0.5,
        "calls": 4,
        "call_success": 0.75,
    }
    empty = rates([(False, 1.0, 0, 0, False)])
    assert empty["answer_from_tool"] is None and empty["call_success"] is None
