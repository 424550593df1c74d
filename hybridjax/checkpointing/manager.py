"""Checkpoints of the RL trainer with orbax's `CheckpointManager`.

A checkpoint `<dir>/global_step_<N>/` (verl's directory name) holds two items:
  * `state`: a pytree of arrays (actor/critic parameters and optimizer states, RNG key data, ...),
    saved sharded and restored straight into the shardings of an abstract target;
  * `meta`: JSON (step, epoch, data-iterator state, counters).

Safety: orbax writes into a temporary directory and renames it when complete, so a process killed
during a save leaves a `*.orbax-checkpoint-tmp-*` directory that `all_steps()` ignores; the
previous checkpoint is untouched because old steps are deleted only after a new one finalises.
Restoring walks the steps newest first and skips (with a warning) any that fails to load.
A state containing NaN or inf is never written.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

STEP_PREFIX = "global_step"
log = logging.getLogger(__name__)


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def all_finite(tree: Any) -> bool:
    """True when every floating-point leaf of `tree` is finite. One compile per tree structure;
    host sync (one scalar)."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return bool(_all_finite(arrays))


def split_checkpoint_path(path: str) -> tuple[str, int]:
    """`/a/b/global_step_12` → (`/a/b`, 12). Raises ValueError for any other name."""
    path = os.path.abspath(path.rstrip("/"))
    match = re.fullmatch(rf"{STEP_PREFIX}_(\d+)", os.path.basename(path))
    if not match:
        raise ValueError(
            f"trainer.resume_mode: {path!r} is not a checkpoint directory "
            f"(expected a name like {STEP_PREFIX}_<step>)"
        )
    return os.path.dirname(path), int(match.group(1))


class Checkpointer:
    """Saves and restores (state pytree, meta dict) pairs under `directory`.

    Args:
      directory: the run's checkpoint root (`trainer.default_local_dir`).
      max_to_keep: newest checkpoints kept (`trainer.max_actor_ckpt_to_keep`).
      async_save: write in a background thread; `wait()` blocks until the last save is done.
    """

    def __init__(self, directory: str, max_to_keep: int, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            step_prefix=STEP_PREFIX,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"), options=options
        )

    def steps(self) -> list[int]:
        """Finalised checkpoint steps, oldest first (partial saves are not listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Starts saving `state` and `meta` as step `step`; returns False (and warns) if skipped.

        A state with a non-finite value is refused. An existing step is not overwritten.
        """
        if step in self._manager.all_steps():
            log.warning("not saving step %d: %s_%d exists and is kept", step, STEP_PREFIX, step)
            return False
        if not all_finite(state):
            log.warning("not saving step %d: the state contains NaN or inf", step)
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict] | None:
        """Loads the newest loadable checkpoint (or exactly `step`) into `target`'s layout.

        Args:
          target: a pytree like the saved state whose leaves are arrays or
            `jax.ShapeDtypeStruct`s with the shardings to restore into.
          step: a specific step; failing to load it raises instead of falling back.
        Returns:
          (step, state, meta), or None when there is no loadable checkpoint.
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            target,
        )
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        unreadable = []
        for candidate in candidates:
            args = ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            )
            try:
                restored = self._manager.restore(candidate, args=args)
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is skipped
                if step is not None:
                    raise
                log.warning("skipping unreadable checkpoint %s_%d: %s", STEP_PREFIX, candidate, err)
                unreadable.append(candidate)
                continue
            self._set_aside(unreadable)
            return candidate, restored.state, dict(restored.meta)
        self._set_aside(unreadable)
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Renames unreadable steps to `global_step_<N>.unreadable` so the run can save step N
        again; nothing is deleted."""
        for s in steps:
            path = os.path.join(self.directory, f"{STEP_PREFIX}_{s}")
            os.replace(path, f"{path}.unreadable")
            log.warning("moved unreadable checkpoint to %s.unreadable", path)
        if steps:
            self._manager.reload()

    def wait(self) -> None:
        """Blocks until the last asynchronous save has finished (and old steps are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
