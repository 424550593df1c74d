"""Config fields that carry their own check: a default, a predicate and the rule it states.

The schema (`hybridjax.config.schema.declared_config`) writes a checked field beside its key,
`train_batch_size=positive(1024)` or `truncation=one_of("error", TRUNCATIONS)`; the default
config takes the defaults, the start-up check (`hybridjax.config.checks.validate`) applies the
predicates and reports `"<key>: <rule> (got <value>)"`, and the configuration reference prints
the rules. So a bound or a list of choices is written once.

Choices may be a function, read when the check runs: the registries (advantage estimators,
policy losses) gain names at run time, and the check never disagrees with what the step runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

Choices = Sequence[Any] | Callable[[], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config field's default and its check.

    Attributes:
      default: the value the default config holds (its type is the field's type).
      ok: `ok(value) -> bool`, true when `value` is allowed.
      says: the rule in words, as the error message and the reference state it; a function
        when the rule names choices that are read at check time.
    """

    default: Any
    ok: Callable[[Any], bool]
    says: str | Callable[[], str]

    @property
    def rule(self) -> str:
        """The rule in words, e.g. "must be > 0" or "one of ('error', 'left')"."""
        return self.says() if callable(self.says) else self.says


def check(default: Any, ok: Callable[[Any], bool], says: str) -> Checked:
    """A field with a hand-written predicate and rule."""
    return Checked(default, ok, says)


def positive(default: Any) -> Checked:
    """`value > 0`."""
    return Checked(default, lambda v: v > 0, "must be > 0")


def at_least(default: Any, low: float, note: str = "") -> Checked:
    """`value >= low`; `note` (e.g. "0: off") is added to the rule in brackets."""
    return Checked(
        default, lambda v: v >= low, f"must be >= {low}" + (f" ({note})" if note else "")
    )


def positive_or_unset(default: Any) -> Checked:
    """`value == -1` (not set: derived elsewhere) or `value > 0`."""
    return Checked(default, lambda v: v == -1 or v > 0, "must be -1 or > 0")


def within(
    default: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Checked:
    """`low <= value <= high`, either end open when asked: "must be in (0, 1]"."""

    def ok(v: Any) -> bool:
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    says = f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return Checked(default, ok, says)


def one_of(default: Any, choices: Choices, note: str = "") -> Checked:
    """`value in choices`; `choices` is a sequence, or a function returning one at check time."""

    def names() -> Sequence[Any]:
        return choices() if callable(choices) else choices

    def says() -> str:
        listed = names()
        shown = list(listed) if callable(choices) else listed
        return f"one of {shown!r}" + (f" ({note})" if note else "")

    return Checked(default, lambda v: v in names(), says if callable(choices) else says())


def subset_of(default: Any, choices: Sequence[Any]) -> Checked:
    """Every element of `value` is in `choices`."""
    return Checked(default, lambda v: set(v) <= set(choices), f"a subset of {tuple(choices)!r}")


def checks(spec: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Checked]]:
    """(dotted key, Checked) for every checked field of a nested mapping, in order."""
    for key, value in spec.items():
        if isinstance(value, Checked):
            yield prefix + key, value
        elif isinstance(value, Mapping) or hasattr(value, "items"):
            yield from checks(value, f"{prefix}{key}.")


def problems(declared: Iterable[tuple[str, Checked]], get: Callable[[str], Any]) -> Iterator[str]:
    """`"<key>: <rule> (got <value>)"` for each declared field whose value (`get(key)`) fails;
    an integer field's value must also fit in 32 bits (`INT32`).

    A value of the wrong type is the type check's to report; its comparison error here is
    skipped.
    """
    for key, field in declared:
        value = get(key)
        try:
            allowed = field.ok(value)
        except TypeError:
            continue
        if not allowed:
            yield f"{key}: {field.rule} (got {value!r})"
        elif _whole(field.default) and _whole(value) and not -INT32 <= value < INT32:
            yield f"{key}: must be below 2**31, a 32-bit integer of the program (got {value!r})"


INT32 = 2**31  # integer fields reach the compiled program as int32


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
