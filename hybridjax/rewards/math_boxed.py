"""MATH-style answers: the content of the last `\\boxed{...}` compared after normalisation.

Follows the checker of the MATH benchmark (Hendrycks et al., 2021, `is_equiv` / `strip_string`),
which verl's `math.py` reward also uses: the last `\\boxed{}` (or `\\fbox{}`) with balanced braces
is the answer; spaces, `\\left`/`\\right`, `\\dfrac`/`\\tfrac`, degree signs, `\\$`, `\\%`, trailing
units in `\\text{}`, a leading `x =` and shorthand such as `\\frac12` or `a/b` are normalised away.
Two answers that both read as plain numbers are compared numerically (`0.50` equals `\\frac{1}{2}`
only through the MATH rule `0.5` → `\\frac{1}{2}`; `1,000` equals `1000`).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` / `\\fbox{...}` (braces balanced) including the command, or None."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):  # `\boxed 5` form: up to the next `$` or end
        return text[idx:].split("$")[0]
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """`\\boxed{x}` → `x` (also `\\boxed x` and `\\fbox{x}`)."""
    for prefix in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix):
            return boxed[len(prefix) :] if prefix.endswith(" ") else boxed[len(prefix) : -1]
    return boxed


def _fix_fracs(s: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\frac1{72}` → `\\frac{1}{72}`."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(s: str) -> str:
    """`3/4` → `\\frac{3}{4}` when both sides are integers."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    """`\\sqrt2` → `\\sqrt{2}`."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_string(s: str) -> str:
    """MATH's answer normalisation (Hendrycks et al. `strip_string`, lightly extended)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # trailing units: "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs = s.split("=")
    if len(lhs) == 2 and len(lhs[0].strip()) <= 2:  # "x = 5" → "5"
        s = lhs[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_a_slash_b(s)
    return s.rstrip(".")


def _as_number(s: str) -> Decimal | None:
    try:
        value = Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def is_equiv(a: str, b: str) -> bool:
    """Whether two answers are the same after `strip_string` (numerically if both are numbers)."""
    sa, sb = strip_string(a), strip_string(b)
    na, nb = _as_number(sa), _as_number(sb)
    if na is not None and nb is not None:
        return na == nb
    return sa == sb


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last `\\boxed{}` of the response equals the ground truth, else 0.0.

    The ground truth may itself be a `\\boxed{}` expression (it is unwrapped).
    """
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = last_boxed_only_string(ground_truth)
    truth = remove_boxed(truth) if truth is not None else ground_truth
    return 1.0 if is_equiv(remove_boxed(boxed), truth) else 0.0
