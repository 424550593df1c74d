"""Checkpoints: orbax save/restore with resume, signal-triggered saves, HF export, and the
lock by which one run owns its directory."""

from hybridjax.checkpointing.manager import Checkpointer, all_finite, split_checkpoint_path
from hybridjax.checkpointing.run_lock import hold as hold_directory
from hybridjax.checkpointing.signals import StopRequest

__all__ = ["Checkpointer", "StopRequest", "all_finite", "hold_directory", "split_checkpoint_path"]
