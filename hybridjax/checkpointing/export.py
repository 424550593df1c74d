"""Export of the trained actor as an HF checkpoint (`config.json`, safetensors, tokenizer)."""

from __future__ import annotations

import logging
import os

from flax import nnx

from hybridjax.models.hf_io import save_pretrained
from hybridjax.models.lora import LoRAModel, merged_model, save_peft_adapter

log = logging.getLogger(__name__)


def export_actor(trainer, directory: str) -> int:
    """Restores `trainer`'s newest checkpoint (per `trainer.resume_mode`) and writes its actor
    and tokenizer to `directory` in HF layout. Returns the exported step.

    Raises:
      FileNotFoundError: there is no loadable checkpoint to export.
    """
    step = trainer.restore()
    if step == 0:
        raise FileNotFoundError(
            f"no loadable checkpoint under {trainer.checkpointer.directory} to export"
        )
    model = nnx.merge(trainer.actor_graphdef, trainer.actor_state.params)
    save_pretrained(merged_model(model), directory)  # LoRA: adapters merged into the weights
    if isinstance(model, LoRAModel):  # and the adapters alone, for peft
        base = trainer.cfg.actor_rollout_ref.model.path
        save_peft_adapter(model, os.path.join(directory, "adapter"), base)
    trainer.tokenizer.save(directory)
    log.info("exported the actor of step %d to %s", step, directory)
    return step
