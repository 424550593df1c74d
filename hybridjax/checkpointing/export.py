"""Export of a trained model as an HF checkpoint (`config.json`, safetensors, tokenizer).

An export only ever replaces an export. It writes, beside its files, a manifest
`.hybridjax-export.json` listing them; a target that exists and is not empty is refused unless
`overwrite` is given, and even then it is replaced only when it holds an earlier export and
nothing else (every file listed in its manifest). Refused, with one line naming the path and
why: a run directory or any of its parents, a model directory the run reads (`inputs`: its
model, tokenizer, critic, reward model, teacher) or any of its parents, anything inside a
checkpoint directory (`global_step_<N>`, or any directory holding orbax's
`_CHECKPOINT_METADATA`), a directory holding a run's lock file (`.<name>.lock`, a live or past
run) or checkpoints, and a directory with files the export did not write. Paths are compared
as real paths and as files (`os.path.samefile`), so another spelling (a link, a bind mount)
of the same directory is refused too. The caller holds the
target through the run lock (`run_lock.hold(..., create=False)`), so a run and an export, or
two exports, never share it.

A crash never leaves a mix of two exports: the files are written into a temporary directory
beside the target (`.<name>.export-tmp-*`) and moved into place with one `rename`. With
`overwrite` the old export is renamed aside (`.<name>.replaced-*`), the new one renamed in, and
only then are the files of the old one's manifest removed (anything else found there is left,
with a warning), so a crash leaves either the old or the new export in place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping

import jax
from flax import nnx

from hybridjax.checkpointing.manager import STEP_PREFIX
from hybridjax.errors import CheckpointError, ExportError
from hybridjax.models.hf_io import save_pretrained
from hybridjax.models.lora import LoRAModel, merged_model, save_peft_adapter

log = logging.getLogger(__name__)

MANIFEST = ".hybridjax-export.json"  # the files an export wrote, relative to its directory
_CHECKPOINT = re.compile(rf"{STEP_PREFIX}_\d+(\..*)?")  # a step, its orbax tmp or set-aside copy
_CHECKPOINT_MARKER = "_CHECKPOINT_METADATA"  # in every checkpoint orbax has written
_LOCK = re.compile(r"\..+\.lock")  # `run_lock.lock_path`'s name
_MAX_SCANNED = 100_000  # entries looked at under a target before it is refused as too big
_SHOWN = 5


def _listed(names: list[str]) -> str:
    """Up to `_SHOWN` names, each on the same line (a name with a newline or bytes that are
    not text is shown as Python writes it)."""
    shown = ", ".join(n if n.isprintable() else repr(n) for n in names[:_SHOWN])
    return shown + (f", ... ({len(names)} entries)" if len(names) > _SHOWN else "")


def _manifest(directory: str) -> set[str] | None:
    """The files an earlier export wrote in `directory` (its manifest), or None without one."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
        return {str(name) for name in files}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _scan(directory: str) -> tuple[list[str], list[str], bool]:
    """(every file under `directory`, relative; the checkpoint directories among its
    subdirectories; whether the scan stopped at `_MAX_SCANNED` entries)."""
    files, checkpoints, seen = [], [], 0
    for root, dirs, names in os.walk(directory):  # does not follow links to directories,
        rel = os.path.relpath(root, directory)  # so each is listed as a file of its own
        for name in dirs:
            if _CHECKPOINT.fullmatch(name):
                checkpoints.append(os.path.normpath(os.path.join(rel, name)))
        links = [n for n in dirs if os.path.islink(os.path.join(root, n))]
        files += [os.path.normpath(os.path.join(rel, n)) for n in names + links]
        seen += len(dirs) + len(names)
        if seen > _MAX_SCANNED:
            return files, checkpoints, True
    return files, checkpoints, False


def _protected_problem(
    path: str, protected: Iterable[str], inputs: Mapping[str, str] | None = None
) -> str | None:
    """Why `path` (a real path) may not be an export target given the run directories
    `protected` and the model directories the run reads `inputs` ({config key: path}), or
    None. Each is matched by real path and by `os.path.samefile` (bind mounts)."""
    for parent in [path, *_ancestors(path)]:
        marked = os.path.isfile(os.path.join(parent, _CHECKPOINT_MARKER))
        if _CHECKPOINT.fullmatch(os.path.basename(parent)) or marked:
            return f"is inside the checkpoint directory {parent}"
    named = [(run, "the run's directory (trainer.default_local_dir), which holds its "
              "checkpoints", "the run directory") for run in protected]  # fmt: skip
    named += [(p, f"{key}, a model the run reads", f"the model of {key},")
              for key, p in (inputs or {}).items()]  # fmt: skip
    for other, what, held in named:
        if not other:
            continue
        other = os.path.realpath(os.path.abspath(other))
        if path == other or _same_file(path, other):
            return f"is {what}"
        if any(path == p or _same_file(path, p) for p in _ancestors(other)):
            return f"holds {held} {other}"
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing
        return False


def _ancestors(path: str) -> list[str]:
    out = []
    while (parent := os.path.dirname(path)) != path:
        out.append(parent)
        path = parent
    return out


def check_export_target(
    directory: str,
    overwrite: bool,
    protected: Iterable[str] = (),
    inputs: Mapping[str, str] | None = None,
) -> None:
    """Raises `ExportError` unless `directory` may receive an export: absent, an empty
    directory, or (with `overwrite`) a directory holding an earlier export and nothing else.
    Never one of the run directories `protected`, a model directory the run reads (`inputs`,
    {config key: path}) or a parent of either, never inside a checkpoint directory, never a
    directory holding a run lock or checkpoints, never a mount point (it cannot be replaced).
    Call it before any long work (and again just
    before writing). Each refusal is one line naming the path and why.
    """
    shown = directory
    path = os.path.realpath(os.path.abspath(directory))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ExportError(f"export target {shown} exists and is not a directory")
    problem = _protected_problem(path, protected, inputs)
    if problem:
        raise ExportError(f"export target {shown} {problem}; choose a directory of its own")
    if os.path.isdir(path) and os.path.ismount(path):
        raise ExportError(
            f"export target {shown} is a mount point: an export replaces its directory whole, "
            "which a mount point does not allow; export to a new directory inside it"
        )
    if not os.path.isdir(path) or not os.listdir(path):
        return
    files, checkpoints, truncated = _scan(path)
    locks = [f for f in files if _LOCK.fullmatch(os.path.basename(f))]
    if locks:
        raise ExportError(
            f"export target {shown} holds a run's lock file ({_listed(locks)}): a run's files "
            "live there; choose a directory of its own"
        )
    if checkpoints:
        raise ExportError(
            f"export target {shown} holds checkpoints ({_listed(checkpoints)}); choose a "
            "directory of its own"
        )
    if not overwrite:
        raise ExportError(
            f"export target {shown} is not empty ({_listed(sorted(os.listdir(path)))}); choose "
            "an empty or new directory, or pass --overwrite to replace an earlier export"
        )
    written = _manifest(path)
    if written is None:
        raise ExportError(
            f"export target {shown} was not written by an export (no {MANIFEST}), so "
            "--overwrite does not replace it; remove it yourself or choose another directory"
        )
    foreign = sorted(set(files) - written - {MANIFEST})
    if foreign or truncated:
        raise ExportError(
            f"export target {shown} holds files the export did not write "
            f"({_listed(foreign) or 'too many to list'}); move them away or choose another "
            "directory"
        )


def _write_manifest(directory: str) -> None:
    files, _, _ = _scan(directory)
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"files": sorted(files)}, f, indent=1)


def _remove_export(directory: str) -> None:
    """Removes the files of an export's manifest under `directory`, then its empty
    directories; anything else is left (with a warning)."""
    written = (_manifest(directory) or set()) | {MANIFEST}
    files, _, _ = _scan(directory)  # only files found under it: a manifest naming `../x` or an
    for name in files:  # absolute path removes nothing outside
        if name in written:
            os.remove(os.path.join(directory, name))
    for root, _, _ in sorted(os.walk(directory), key=lambda x: -len(x[0])):
        with_files = os.listdir(root)
        if not with_files:
            os.rmdir(root)
    if os.path.isdir(directory):
        log.warning("kept %s: it held files the replaced export did not write", directory)


def write_hf_export(
    model,
    tokenizer,
    directory: str,
    overwrite: bool = False,
    adapter_base: str = "",
    protected: Iterable[str] = (),
    inputs: Mapping[str, str] | None = None,
) -> None:
    """Writes `model` (a CausalLM) and `tokenizer` to `directory` in HF layout, atomically,
    with the manifest of its files. A LoRA model is written with its adapters merged into the
    weights, and the adapters alone (peft layout, base model `adapter_base`) under `adapter/`.
    `protected`, `inputs`: run directories and the model directories the run reads, which
    the export must not replace (see `check_export_target`).

    Raises:
      ExportError: the target is refused (`check_export_target`), or could not be moved aside
        (unchanged).
      OSError: writing failed (the target is unchanged; the temporary directory is removed).
    """
    check_export_target(directory, overwrite, protected, inputs)
    directory = os.path.realpath(os.path.abspath(directory.rstrip("/")))  # a link: its target
    if jax.process_index() != 0:  # gathering is collective; only process 0 writes
        save_pretrained(merged_model(model), directory)
        return
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.export-tmp-", dir=parent)
    try:
        save_pretrained(merged_model(model), tmp)  # LoRA: adapters merged into the weights
        if isinstance(model, LoRAModel):  # and the adapters alone, for peft
            save_peft_adapter(model, os.path.join(tmp, "adapter"), adapter_base)
        tokenizer.save(tmp)
        _write_manifest(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.isdir(directory):
            check_export_target(directory, overwrite, protected, inputs)  # again, just before
            aside = tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent)
            try:
                os.replace(directory, aside)  # an empty directory, or an earlier export
            except OSError as e:  # e.g. busy (in use as a mount point or a cwd elsewhere)
                os.rmdir(aside)
                raise ExportError(f"cannot replace export target {directory}: {e.strerror}; "
                                  "it is unchanged") from e  # fmt: skip
            os.replace(tmp, directory)
            _remove_export(aside)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_actor(trainer, directory: str, overwrite: bool = False) -> int:
    """Restores `trainer`'s newest checkpoint (per `trainer.resume_mode`, read-only) and writes
    its actor and tokenizer to `directory` in HF layout (see `write_hf_export`). Returns the
    exported step.

    Raises:
      ExportError: the target is refused (checked before restoring; `check_export_target`).
      CheckpointError: there is no loadable checkpoint, or it does not match the config.
    """
    protected, inputs = export_protected(trainer.cfg), export_inputs(trainer.cfg)
    check_export_target(os.path.abspath(directory), overwrite, protected, inputs)
    step = trainer.restore()
    if step == 0:
        raise CheckpointError(
            f"no loadable checkpoint under {trainer.checkpointer.directory} to export "
            "(trainer.default_local_dir, or trainer.resume_mode=<path>/global_step_<N>)"
        )
    model = nnx.merge(trainer.actor_graphdef, trainer.actor_state.params)
    write_hf_export(model, trainer.tokenizer, directory, overwrite,
                    adapter_base=trainer.cfg.actor_rollout_ref.model.path,
                    protected=protected, inputs=inputs)  # fmt: skip
    log.info("exported the actor of step %d to %s", step, directory)
    return step


def export_protected(cfg) -> list[str]:
    """The run directories an RL export must not replace: `trainer.default_local_dir` and the
    directory of an explicit `trainer.resume_mode` checkpoint."""
    t = cfg.trainer
    dirs = [t.default_local_dir]
    if t.resume_mode not in ("auto", "disable"):
        dirs.append(os.path.dirname(os.path.abspath(t.resume_mode.rstrip("/"))))
    return dirs


def export_inputs(cfg) -> dict[str, str]:
    """The model directories an RL run reads ({config key: path}, the set ones), which its
    export must not replace: a resumed run reads them again (the reference policy, LoRA's base,
    the critic's start, the tokenizer)."""
    keys = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path",
            "actor_rollout_ref.distillation.teacher_model.path", "data.tokenizer")  # fmt: skip
    return {key: path for key in keys if (path := _config_value(cfg, key))}


def _config_value(cfg, dotted: str) -> str:
    for part in dotted.split("."):
        cfg = cfg.get(part) if hasattr(cfg, "get") else None
    return cfg if isinstance(cfg, str) else ""
