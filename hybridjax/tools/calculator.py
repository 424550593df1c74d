"""A safe arithmetic calculator: the expression is parsed with `ast` and evaluated node by node
(numbers, + - * / // % **, unary minus, parentheses, and a few math functions); nothing is
`eval`-ed, names and attributes are rejected, and exponents and results are bounded."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from hybridjax.tools.base import Tool, register_tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100
MAX_LENGTH = 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression such as "(12 + 30) * 1.5 - 2**3".

    Raises ValueError (with the offending piece) for anything else: names, calls other than
    sqrt/abs/round/min/max, exponents above 100, results above 1e100, texts over 200 characters;
    ZeroDivisionError for a division by zero.
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} above {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        value = _FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
    else:
        raise ValueError(f"unsupported element: {ast.unparse(node)!r}")
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"result out of range: {value}")
    return value


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
