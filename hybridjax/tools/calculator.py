"""A safe arithmetic calculator: the expression is parsed with `ast` and evaluated node by node
(numbers, + - * / // % **, unary minus, parentheses, and a few math functions); nothing is
`eval`-ed, names and attributes are rejected.

Every operation is bounded before it runs, not after: each operand is a number of magnitude
at most `MAX_MAGNITUDE` (so products and quotients stay small), a power's exponent is at most
`MAX_EXPONENT` and its integer result at most `MAX_RESULT_BITS` bits, and each function
argument that sets an amount of work (`round`'s digits) is bounded like an exponent. Python's
big-integer routines hold the GIL, so a bound checked after the fact could never fire; the
executor's worker-process deadline is the second line of defence."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from hybridjax.tools.base import Tool, register_tool

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
}
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100
MAX_LENGTH = 200
MAX_RESULT_BITS = 4096  # an integer power's result, checked before computing it
# per function: index -> bound of the arguments that set an amount of work, not a value
_WORK_ARGS = {"round": {1: MAX_EXPONENT}}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression such as "(12 + 30) * 1.5 - 2**3".

    Raises ValueError (with the offending piece) for anything else: names, calls other than
    sqrt/abs/round/min/max, exponents or `round` digits above 100 in magnitude, operands or
    results above 1e100, texts over 200 characters; ZeroDivisionError for a division by zero;
    OverflowError for a float power beyond float range.
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    value: Any
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        args = [_eval(a) for a in node.args]
        for i, bound in _WORK_ARGS.get(node.func.id, {}).items():
            if i < len(args) and abs(args[i]) > bound:
                raise ValueError(f"{node.func.id} argument {i + 1} ({args[i]}) above {bound}")
        value = _FUNCTIONS[node.func.id](*args)
    else:
        raise ValueError(f"unsupported element: {ast.unparse(node)!r}")
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"result out of range: {value}")
    return value


def _check_power(base: int | float, exponent: int | float) -> None:
    """Raises ValueError when `base ** exponent` would be costly to compute."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} above {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if base.bit_length() * exponent > MAX_RESULT_BITS:
            raise ValueError(f"result out of range: {base} ** {exponent}")


def format_number(value: int | float) -> str:
    """Integers without a decimal point, floats rounded to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@register_tool("calculator")
class CalculatorTool(Tool):
    """`calculator(expression)`: the value of an arithmetic expression (`evaluate`)."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. '(12 + 30) * 1.5'.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression"}},
                "required": ["expression"],
            },
        },
    }

    def execute(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError("argument 'expression' (a string) is required")
        return format_number(evaluate(expression))
