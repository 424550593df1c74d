"""XLA:GPU's bytes of a compiled program, as the planner reads them on compile-only GPUs.

A program's own peak per device is `arguments + outputs - aliased + scratch` (XLA's memory
analysis: the inputs it reads, the outputs it writes, minus the donated inputs it writes in
place, plus its temp buffers); a stage's peak adds what other stages keep resident while it
runs. An update whose returned state leaf has another sharding than the donated input leaf
cannot write it in place (`resharded_leaves`; `hybridjax.sharding.layout` pins them).
"""

from __future__ import annotations

from typing import Any

import jax


def compile_on(mesh: Any, fn: Any, args: tuple, catch: bool) -> tuple[Any, str]:
    """(`fn` lowered for `args` under `pass_mesh(mesh)` and compiled, ""); with `catch`, a
    compiler error gives (None, its first line) instead of raising (the planner reports it:
    a program XLA:GPU cannot compile cannot run on that GPU)."""
    from hybridjax.sharding.mesh import pass_mesh

    try:
        with pass_mesh(mesh):
            return fn.lower(*args).compile(), ""
    except jax.errors.JaxRuntimeError as err:
        if not catch:
            raise
        return None, str(err).strip().splitlines()[0][:400]


def memory_of(compiled: Any) -> dict[str, int]:
    """{"arguments", "outputs", "aliased", "scratch"}: per-device bytes of a compiled program."""
    m = compiled.memory_analysis()
    return {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "scratch": m.temp_size_in_bytes,
    }


def program_peak(m: dict[str, int]) -> int:
    """Bytes per device while a program runs: arguments + outputs − aliased + scratch."""
    return m["arguments"] + m["outputs"] - m["aliased"] + m["scratch"]


def resharded_leaves(compiled: Any, state: Any) -> list[str]:
    """The leaves of `state` (the program's second argument, returned as its first output)
    that the compiled program returns with another sharding than they came in with."""
    inputs = jax.tree_util.tree_leaves_with_path(state)
    outputs = jax.tree.leaves(compiled.output_shardings[0])
    return [
        jax.tree_util.keystr(path)
        for (path, x), out in zip(inputs, outputs, strict=True)
        if not out.is_equivalent_to(x.sharding, len(x.shape))
    ]


def relayout_scratch(params: Any, shardings: Any, dtype: Any) -> int:
    """The most scratch one leaf's move into the generation layout takes (`update_weights`
    moves one leaf at a time): XLA's temp bytes per device of each distinct move."""
    from hybridjax.sharding.reshard import move_memory_bytes

    seen: dict[Any, int] = {}
    for leaf, target in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
        key = (leaf.shape, leaf.dtype, leaf.sharding, target)
        if key not in seen:
            cast = dtype if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) else None
            seen[key] = move_memory_bytes(leaf, target, cast)["temp"]
    return max(seen.values(), default=0)
