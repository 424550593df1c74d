"""Checkpoints of the trainers with orbax's `CheckpointManager`, verified when read.

A checkpoint `<dir>/global_step_<N>/` (verl's directory name) holds two items:
  * `state`: a pytree of arrays (actor/critic parameters and optimizer states, ...), saved
    sharded and restored straight into the shardings of an abstract target;
  * `meta`: JSON (step, data-iterator state, counters);
plus `checksums.json`, the SHA-256 of every file of the checkpoint.

Why a manifest of our own: orbax 0.12 builds the zarr3 codec chain itself (`bytes` + `zstd`
for the chunks; only the shard *index* carries TensorStore's `crc32c` codec) and offers no
option to add `crc32c` to the chunk codecs, and zstd frames are written without their content
checksum, so a chunk overwritten on disk decodes into wrong numbers without an error. The
manifest is written by orbax's own `post_finalization_callback`, i.e. inside the temporary
directory before orbax renames it into place: a checkpoint is committed with its checksums or
not at all. Hashing runs in orbax's background thread (about 1 GB/s), off the training loop.

Restoring a checkpoint, newest first:
  1. checksums: a missing or changed file makes it *unreadable*;
  2. structure: the saved tree, shapes and dtypes must equal the target's, and the caller's
     `check_meta` (e.g. the data iterator's size) must pass; otherwise it *does not match this
     config*: `CheckpointError` names each difference with both values and the ways out. A
     valid checkpoint is never skipped for not matching;
  3. the arrays load, and every floating-point value is finite; otherwise *unreadable*.
An unreadable checkpoint is skipped with a warning naming the file and the reason; skipping
never renames or deletes it. When every checkpoint is unreadable, restoring is an error naming
each (never a silent fresh start over a run's checkpoints). Only when the resumed run reaches
that step again and saves it is the unreadable directory moved aside
(`global_step_<N>.unreadable`, never over another one) to make room; orbax's keep-N policy
removes old steps only after a newer one is committed.
Read-only users (`read_only=True`: export, an explicit resume path) never create, change or
delete anything under the directory.

Safety of saving: orbax writes into `global_step_<N>.orbax-checkpoint-tmp` and renames it when
complete, so a process killed during a save (or a full disk) leaves the previous checkpoint
untouched; old steps are deleted only after a new one is committed. A state containing NaN or
inf is never written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from hybridjax.errors import CheckpointError

STEP_PREFIX = "global_step"
CHECKSUMS_FILE = "checksums.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
ITEMS = ("state", "meta")
MAX_LISTED = 12  # mismatches named in one message (parameters first)
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
    """True when every floating-point leaf of `tree` is finite. Leaves are checked in one
    jitted call per set of devices they live on (restored leaves are committed to theirs);
    one compile per tree structure; host sync (one scalar per device set)."""
    groups: dict[Any, list[jax.Array]] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            key = frozenset(d.id for d in x.sharding.device_set) if x.committed else None  # type: ignore[attr-defined]
            groups.setdefault(key, []).append(x)
    uncommitted = groups.pop(None, [])
    if groups and uncommitted:  # uncommitted leaves follow any committed group
        next(iter(groups.values())).extend(uncommitted)
    elif uncommitted:
        groups[None] = uncommitted
    return all(bool(_all_finite(arrays)) for arrays in groups.values())


def split_checkpoint_path(path: str) -> tuple[str, int]:
    """`/a/b/global_step_12` → (`/a/b`, 12).

    Raises:
      CheckpointError: any other name (says what `trainer.resume_mode` accepts).
    """
    given, path = path, os.path.abspath(path.rstrip("/"))
    match = re.fullmatch(rf"{STEP_PREFIX}_(\d+)", os.path.basename(path))
    if not match:
        raise CheckpointError(
            f"trainer.resume_mode: {given!r} is not a checkpoint directory; valid values are "
            f"'auto', 'disable' or a path ending in {STEP_PREFIX}_<step>"
        )
    return os.path.dirname(path), int(match.group(1))


def file_checksums(directory: str) -> dict[str, str]:
    """SHA-256 (hex) of every file of the items (`state/`, `meta/`) under a checkpoint
    `directory`, by relative path. The step's own files (`_CHECKPOINT_METADATA`,
    `commit_success.txt`) are orbax's bookkeeping, rewritten when it commits, so not hashed."""
    out = {}
    for item in ITEMS:
        for root, _, files in os.walk(os.path.join(directory, item)):
            for name in files:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, directory)] = hashlib.file_digest(
                        f, "sha256"
                    ).hexdigest()
    return dict(sorted(out.items()))


def checksum_problems(directory: str) -> list[str] | None:
    """Files of a checkpoint directory that are missing or differ from its manifest (empty:
    all verified); None when the directory has no manifest (written before checksums)."""
    manifest = os.path.join(directory, CHECKSUMS_FILE)
    if not os.path.isfile(manifest):
        return None
    try:
        with open(manifest, encoding="utf-8") as f:
            expected = json.load(f)["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{manifest}: unreadable manifest ({err})"]
    problems = []
    for rel, digest in expected.items():
        path = os.path.join(directory, rel)
        try:
            with open(path, "rb") as f:
                actual = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as err:
            problems.append(f"{path}: {err.strerror or err}")
            continue
        if actual != digest:
            problems.append(f"{path}: checksum mismatch")
    return problems


def _leaf_name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_leaf_name(p): (tuple(x.shape), str(x.dtype)) for p, x in flat}


def tree_mismatches(saved: Any, target: Any) -> list[str]:
    """Every difference between a saved tree's metadata and the target tree: missing and
    unexpected leaves, shapes and dtypes (both values named)."""
    have, want = _leaves(saved), _leaves(target)
    problems = []
    order = lambda name: ("opt_state" in name, name)  # noqa: E731 - parameters first
    for name in sorted(want.keys() - have.keys(), key=order):
        problems.append(f"{name}: not in the checkpoint (this config has shape {want[name][0]})")
    for name in sorted(have.keys() - want.keys(), key=order):
        problems.append(f"{name}: in the checkpoint (shape {have[name][0]}), not in this config")
    for name in sorted(have.keys() & want.keys(), key=order):
        (s_shape, s_dtype), (t_shape, t_dtype) = have[name], want[name]
        if s_shape != t_shape:
            problems.append(f"{name}: shape {s_shape} in the checkpoint, {t_shape} in this config")
        elif s_dtype != t_dtype:
            problems.append(f"{name}: dtype {s_dtype} in the checkpoint, {t_dtype} in this config")
    return problems


class _Unreadable(Exception):
    """Internal: this checkpoint cannot be used (the message says why)."""


class Checkpointer:
    """Saves and restores (state pytree, meta dict) pairs under `directory`.

    Args:
      directory: the run's checkpoint root (`trainer.default_local_dir`).
      max_to_keep: newest checkpoints kept (`trainer.max_actor_ckpt_to_keep`).
      read_only: never create, write or delete anything (export, an explicit resume path).
    """

    def __init__(self, directory: str, max_to_keep: int, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.read_only = read_only
        self._saving: int | None = None
        self._unreadable: set[int] = set()  # skipped by `restore`; replaced only when re-saved
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            step_prefix=STEP_PREFIX,
            enable_async_checkpointing=True,
            create=not read_only,
            read_only=read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums),
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(
            self.directory, item_handlers=handlers, options=options
        )

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, f"{STEP_PREFIX}_{step}")

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (partial saves are not listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    # ------------------------------------------------------------------------------ saving

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Starts saving `state` and `meta` as step `step`; returns False (and warns) if skipped.

        A state with a non-finite value is refused. An existing step is not overwritten, unless
        `restore` found it unreadable: then it is moved aside (see the module docstring).
        Errors of an earlier asynchronous save (a full disk) are raised here or by `wait()`.
        """
        if self.read_only:
            raise RuntimeError(f"checkpointer of {self.directory} is read-only")
        if step in self._manager.all_steps():
            if step not in self._unreadable:
                log.warning("not saving step %d: %s exists and is kept", step, self.step_path(step))
                return False
            self._set_aside(step)
        if not all_finite(state):
            log.warning("not saving step %d: the state contains NaN or inf", step)
            return False
        self._manager.wait_until_finished()  # one save in flight: the callback knows its step
        self._saving = step
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return bool(self._manager.save(step, args=args, force=True))

    def _set_aside(self, step: int) -> None:
        """Moves a checkpoint found unreadable by this process's restore out of the way of its
        replacement, to a free `global_step_<N>.unreadable[-k]` name (never over another)."""
        path = self.step_path(step)
        target, k = f"{path}.unreadable", 0
        while os.path.lexists(target):
            k += 1
            target = f"{path}.unreadable-{k}"
        os.rename(path, target)
        self._unreadable.discard(step)
        self._manager.reload()
        log.warning("step %d is saved again: the unreadable %s is kept as %s", step, path, target)

    def _write_checksums(self) -> None:
        """orbax's post-finalization callback: the manifest of the step being saved, written
        into its temporary directory before orbax commits it (process 0 only)."""
        if self._saving is None or jax.process_index() != 0:
            return
        final = self.step_path(self._saving)
        directory = final + TMP_SUFFIX if os.path.isdir(final + TMP_SUFFIX) else final
        manifest = {"algorithm": "sha256", "sha256": file_checksums(directory)}
        tmp = os.path.join(directory, CHECKSUMS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, CHECKSUMS_FILE))

    # ------------------------------------------------------------------------------ restoring

    def restore(
        self,
        target: Any,
        step: int | None = None,
        check_meta: Callable[[dict], list[str]] | None = None,
    ) -> tuple[int, Any, dict] | None:
        """Loads the newest usable checkpoint (or exactly `step`) into `target`'s layout.

        Args:
          target: a pytree like the saved state whose leaves are arrays or
            `jax.ShapeDtypeStruct`s with the shardings to restore into.
          step: a specific step; it must exist and be readable (no fallback).
          check_meta: returns the ways a checkpoint's meta dict does not fit this run (e.g.
            the data iterator's size); any makes it a mismatch.
        Returns:
          (step, state, meta) of the newest readable one (unreadable ones skipped with a
          warning naming the file), or None when there is no checkpoint.
        Raises:
          CheckpointError: a checkpoint does not match `target`'s tree, shapes or dtypes, or
            `check_meta` (each difference named with both values); `step` does not exist or is
            unreadable; every checkpoint is unreadable (each named with its reason).
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            target,
        )
        available = self.steps() if os.path.isdir(self.directory) else []
        if step is not None and step not in available:
            listed = ", ".join(self.step_path(s) for s in available) or "none"
            raise CheckpointError(
                f"trainer.resume_mode: {self.step_path(step)} is not a checkpoint "
                f"(checkpoints in {self.directory}: {listed})"
            )
        unreadable = []
        for candidate in [step] if step is not None else sorted(available, reverse=True):
            try:
                return self._restore_one(candidate, abstract, check_meta)
            except _Unreadable as err:
                if step is not None:
                    raise CheckpointError(
                        f"{self.step_path(candidate)} is unreadable: {err}"
                    ) from err
                log.warning(
                    "skipping unreadable checkpoint %s (kept as it is): %s",
                    self.step_path(candidate),
                    err,
                )
                self._unreadable.add(candidate)
                unreadable.append(f"{self.step_path(candidate)} ({err})")
        if unreadable:  # not a fresh start over a run's checkpoints
            raise CheckpointError(
                f"every checkpoint in {self.directory} is unreadable: {'; '.join(unreadable)}; "
                "restore them, or start afresh with trainer.resume_mode=disable or another "
                "trainer.default_local_dir"
            )
        return None

    def _restore_one(self, step: int, abstract: Any, check_meta) -> tuple[int, Any, dict]:
        path = self.step_path(step)
        problems = checksum_problems(path)
        if problems is None:
            log.warning("%s has no %s (saved before checksums): not verified", path, CHECKSUMS_FILE)
        elif problems:
            raise _Unreadable("; ".join(problems))
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as err:  # noqa: BLE001 - any failure to read means unreadable
            raise _Unreadable(f"cannot read its metadata ({_first_line(err)})") from err
        if saved is None:
            raise _Unreadable("it has no state metadata")
        mismatches = tree_mismatches(saved, abstract)
        if mismatches:
            raise _mismatch_error(path, mismatches)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as err:  # noqa: BLE001 - any failure to read means unreadable
            raise _Unreadable(_first_line(err)) from err
        meta = dict(restored.meta or {})
        mismatches = check_meta(meta) if check_meta is not None else []
        if mismatches:
            raise _mismatch_error(path, mismatches)
        if not all_finite(restored.state):
            raise _Unreadable("the restored state contains NaN or inf")
        return step, restored.state, meta

    def wait(self) -> None:
        """Blocks until the last asynchronous save has finished (and old steps are deleted);
        raises that save's error, if any."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self._manager.wait_until_finished()
        finally:
            self._manager.close()


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    line = text.splitlines()[0]
    return line[:300] + ("…" if len(line) > 300 else "")


def _mismatch_error(path: str, problems: list[str]) -> CheckpointError:
    listed = problems[:MAX_LISTED]
    more = len(problems) - len(listed)
    lines = "\n  ".join(listed + ([f"... and {more} more"] if more else []))
    return CheckpointError(
        f"checkpoint {path} does not match this config ({len(problems)} difference"
        f"{'s' * (len(problems) > 1)}):\n  {lines}\n"
        "Either run with the config it was saved with, or start afresh: "
        "trainer.resume_mode=disable or another trainer.default_local_dir."
    )
