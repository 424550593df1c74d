"""Checkpoints: orbax save/restore with resume, signal-triggered saves, HF export."""

from hybridjax.checkpointing.manager import Checkpointer, all_finite, split_checkpoint_path
from hybridjax.checkpointing.signals import StopRequest

__all__ = ["Checkpointer", "StopRequest", "all_finite", "split_checkpoint_path"]
