"""A strict name → function registry (advantage estimators, policy losses).

Strict means: registering a name twice raises, and looking up an unknown name raises a
`ValueError` that lists every valid name. Config validation is the lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps names to functions of one kind (`kind` is used in error messages only)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@registry.register("gae")`. Raises ValueError if `name` is taken."""

        def decorator(fn: F) -> F:
            if name in self._fns:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._fns[name].__qualname__})"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as `name`; raises ValueError listing the valid names."""
        if name not in self._fns:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"
            )
        return self._fns[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns
