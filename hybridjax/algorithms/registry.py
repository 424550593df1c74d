"""Strict name → function registries: advantage estimators, policy losses, KL estimators,
rollout corrections (mismatch masks).

Strict means: registering a name twice raises, and looking up an unknown name raises a
`ValueError` that lists every valid name. Config validation is the lookup.

The registries live here, in a module that imports nothing else of the package, so the imports
run one way: `registry` ← `config` (validates names by lookup) ← `advantages`, `losses`, `kl`
(register functions whose signatures take the configs). `hybridjax.algorithms` imports those
modules, so the registries are filled before any config is built.
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


ADV_ESTIMATORS: Registry = Registry("advantage estimator")  # algorithm.adv_estimator
POLICY_LOSSES: Registry = Registry("policy loss")  # actor.policy_loss.loss_mode
KL_ESTIMATORS: Registry = Registry("KL estimator")  # algorithm.kl_penalty, actor.kl_loss_type
ROLLOUT_REJECTIONS: Registry = Registry("rollout correction")  # algorithm.rollout_rs
