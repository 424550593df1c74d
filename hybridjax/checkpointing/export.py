"""Export of a trained model as an HF checkpoint (`config.json`, safetensors, tokenizer).

An export never deletes a file it did not write, and a crash never leaves a mix of two
exports: the files are written into a temporary directory beside the target
(`.<name>.export-tmp-*`) and moved into place with one `rename`. A target that exists and is not
empty is refused unless `overwrite` is given; then the old directory is renamed aside
(`.<name>.replaced-*`), the new one renamed in, and only then the old one removed, so a crash
leaves either the old or the new export in place (and at worst the other one beside it).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import jax
from flax import nnx

from hybridjax.errors import CheckpointError, ExportError
from hybridjax.models.hf_io import save_pretrained
from hybridjax.models.lora import LoRAModel, merged_model, save_peft_adapter

log = logging.getLogger(__name__)


def check_export_target(directory: str, overwrite: bool) -> None:
    """Raises `ExportError` unless `directory` is absent, an empty directory, or (with
    `overwrite`) a directory. Call it before any long work."""
    if os.path.isdir(directory):
        if os.listdir(directory) and not overwrite:
            names = sorted(os.listdir(directory))
            shown = ", ".join(names[:5]) + (
                f", ... ({len(names)} entries)" if len(names) > 5 else ""
            )
            raise ExportError(
                f"export target {directory} is not empty ({shown}); choose an empty or new "
                "directory, or pass --overwrite to replace it"
            )
    elif os.path.lexists(directory):
        raise ExportError(f"export target {directory} exists and is not a directory")


def write_hf_export(
    model, tokenizer, directory: str, overwrite: bool = False, adapter_base: str = ""
) -> None:
    """Writes `model` (a CausalLM) and `tokenizer` to `directory` in HF layout, atomically. A
    LoRA model is written with its adapters merged into the weights, and the adapters alone
    (peft layout, base model `adapter_base`) under `adapter/`.

    Raises:
      ExportError: the target is not empty and `overwrite` is False, or is a file.
      OSError: writing failed (the target is unchanged; the temporary directory is removed).
    """
    directory = os.path.abspath(directory.rstrip("/"))
    check_export_target(directory, overwrite)
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
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        if os.path.isdir(directory):
            aside = tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent)
            os.replace(directory, aside)  # an empty directory, or --overwrite
            os.replace(tmp, directory)
            shutil.rmtree(aside)
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
      ExportError: the target would lose files (checked before restoring).
      CheckpointError: there is no loadable checkpoint, or it does not match the config.
    """
    check_export_target(os.path.abspath(directory), overwrite)
    step = trainer.restore()
    if step == 0:
        raise CheckpointError(
            f"no loadable checkpoint under {trainer.checkpointer.directory} to export "
            "(trainer.default_local_dir, or trainer.resume_mode=<path>/global_step_<N>)"
        )
    model = nnx.merge(trainer.actor_graphdef, trainer.actor_state.params)
    write_hf_export(model, trainer.tokenizer, directory, overwrite,
                    adapter_base=trainer.cfg.actor_rollout_ref.model.path)  # fmt: skip
    log.info("exported the actor of step %d to %s", step, directory)
    return step
