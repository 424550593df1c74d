"""GSM8K answer checking (also used by the arithmetic task, whose answers have the same form).

Two ways to read a response's answer (docs/verl_behaviour.md, "Rewards"):
  * strict: the number after the **last** `####` marker (verl's default for GSM8K);
  * flexible: the last number anywhere in the response.

Numbers are compared as numbers, not strings: thousands separators (`1,234`), a currency sign,
markdown bold (`**42**`), a trailing full stop, a `+` sign, the Unicode minus and trailing decimal
zeros (`18.00`) do not make an answer different. verl's own regex takes the first `####` and
compares raw strings; here the last one counts and `#### 1,234` matches `1234`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number: optional sign, digits with well-formed thousands groups (or plain digits), decimals.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
# `####`, then optional spaces / markdown / currency / colon, then the number.
_STRICT_RE = re.compile(r"####[\s*:$]*(" + _NUMBER + r")")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\uff0d": "-"})


def parse_number(text: str) -> Decimal | None:
    """The number a person would read in `text` (`"$1,234.50"` → 1234.50), or None."""
    text = text.strip().translate(_MINUS_SIGNS).replace("$", "").replace("**", "")
    text = text.rstrip(".").replace(",", "").rstrip("%").strip()
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _numbers(text: str) -> list[str]:
    """Every number in `text`; a `-` right after a letter or digit is subtraction, not a sign."""
    found = []
    for m in _NUMBER_RE.finditer(text):
        s = m.group(0)
        if s[0] in "+-" and m.start() > 0 and text[m.start() - 1].isalnum():
            s = s[1:]
        found.append(s)
    return found


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string of a response, or None when it has none.

    Args:
      solution_str: the decoded response.
      method: `strict` (the number after the last `####`) or `flexible` (the last number).

    Raises:
      ValueError: unknown `method`.
    """
    text = solution_str.translate(_MINUS_SIGNS)
    if method == "strict":
        matches = _STRICT_RE.findall(text)
        return matches[-1] if matches else None
    if method == "flexible":
        numbers = _numbers(text)
        return numbers[-1] if numbers else None
    raise ValueError(f"unknown GSM8K extraction method {method!r}; expected strict or flexible")


def answers_match(answer: str, ground_truth: str) -> bool:
    """Numeric equality when both parse as numbers, else equality of the stripped strings."""
    a, g = parse_number(answer), parse_number(str(ground_truth))
    if a is not None and g is not None:
        return a == g
    return answer.strip() == str(ground_truth).strip()


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's `gsm8k.compute_score`: `score` for a right answer, `format_score` for a wrong one,
    0 when no answer can be read."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answers_match(answer, ground_truth) else format_score


def compute_score_flexible(solution_str: str, ground_truth: str) -> float:
    """`compute_score` in flexible mode (the last number in the response)."""
    return compute_score(solution_str, ground_truth, method="flexible")
