"""Jitted updates whose returned state keeps the layout of the state they were given.

An update pass takes a sharded state (parameters, optimizer moments), donates it, and returns
the new one. Left to itself XLA chooses the returned state's shardings by propagation, and
XLA:GPU may choose replicated ones: the 7B PPO critic's new TrainState came back whole on
every device (outputs 84.85 GB per device, nothing aliased to the donated input). XLA:CPU
kept it sharded, so nothing run on CPU showed it. `jit_keeping_state` pins the returned
state to the input's shardings (`jax.lax.with_sharding_constraint`), so it stays sharded and
the donated buffers are reused in place.

    update = jit_keeping_state(passes.update_actor, static_argnums=(0, 4), state_argnum=1)
    state, metrics, nan = update(graphdef, state, batch, rng, cfg)   # state: as it came in
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class Layout:
    """The tree structure and leaf shardings of a state (hashable: a static jit argument)."""

    treedef: Any
    shardings: tuple[Sharding, ...]

    @classmethod
    def of(cls, tree: Any) -> Layout | None:
        """The layout of `tree` (arrays or `jax.ShapeDtypeStruct`s with shardings), or None
        when a leaf has no concrete sharding (a tracer, an unsharded abstract value)."""
        leaves, treedef = jax.tree.flatten(tree)
        shardings = [getattr(x, "sharding", None) for x in leaves]
        if not all(isinstance(s, Sharding) for s in shardings):
            return None
        return cls(treedef, tuple(s for s in shardings if isinstance(s, Sharding)))

    def constrain(self, tree: Any) -> Any:
        """`tree` constrained, leaf by leaf, to this layout (inside a jitted function).

        Raises:
          ValueError: `tree` has another structure than the state the layout was read from.
        """
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"returned state {treedef} differs from the input's {self.treedef}")
        pinned = [
            jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(leaves, self.shardings, strict=True)
        ]
        return jax.tree.unflatten(treedef, pinned)


class StateJit:
    """`jax.jit(fn)` for `fn(*args) -> (state, *rest)` that takes a state at `state_argnum`,
    donates it, and returns the new state (same structure) with the input's shardings. The
    other outputs are left to XLA. Compiles once per input layout (the layout is a static
    argument of the jitted function); `lower(*args)` lowers it as a call would."""

    def __init__(self, fn: Callable[..., Any], static_argnums: Sequence[int], state_argnum: int):
        self.__wrapped__ = fn
        self.__doc__ = fn.__doc__
        self._state_argnum = state_argnum
        self._layouts: dict[Any, Layout] = {}

        def pinned(layout: Layout | None, *args: Any) -> Any:
            state, *rest = fn(*args)
            return (state if layout is None else layout.constrain(state), *rest)

        statics = (0, *(i + 1 for i in static_argnums))
        self._jit = jax.jit(pinned, static_argnums=statics, donate_argnums=state_argnum + 1)

    def __call__(self, *args: Any) -> Any:
        return self._jit(self._layout(args[self._state_argnum]), *args)

    def lower(self, *args: Any) -> Any:
        """`jax.jit(...).lower` of the call with `args` (arrays or ShapeDtypeStructs)."""
        return self._jit.lower(self._layout(args[self._state_argnum]), *args)

    def _layout(self, state: Any) -> Layout | None:
        """The layout of `state`; the one seen before for its tree when every leaf's sharding
        is equivalent to it (a returned state's shardings may be other objects naming the same
        placement, and a new static argument would compile the pass again)."""
        layout = Layout.of(state)
        if layout is None:
            return None
        known = self._layouts.get(layout.treedef)
        leaves = jax.tree.leaves(state)
        if known is not None and all(
            a == b or a.is_equivalent_to(b, len(x.shape))
            for a, b, x in zip(known.shardings, layout.shardings, leaves, strict=True)
        ):
            return known
        self._layouts[layout.treedef] = layout
        return layout


def jit_keeping_state(
    fn: Callable[..., Any], *, static_argnums: Sequence[int], state_argnum: int
) -> StateJit:
    """`fn` jitted with `static_argnums`, its `state_argnum` argument donated and its first
    output pinned to that argument's shardings (see the module docstring)."""
    return StateJit(fn, static_argnums, state_argnum)
