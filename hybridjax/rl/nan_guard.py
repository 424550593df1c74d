"""Non-finite updates: the update phase skips an optimizer step whose loss or gradient norm is
NaN/inf (`trainer.update`); this counts the skips per training step and stops the run after
`trainer.max_consecutive_nan_steps` steps in a row that had any."""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps whose updates were skipped for NaN/inf loss or gradients."""


@dataclasses.dataclass
class NanGuard:
    """Skipped-update counters (checkpointed with the step as `nan_consecutive`, `nan_total`)."""

    max_consecutive: int
    consecutive: int = 0  # steps in a row with at least one skipped update
    total: int = 0  # skipped updates since the run began

    def count(self, skipped: int, step: int) -> None:
        """Records step `step`'s `skipped` updates; a clean step resets the streak.

        Raises:
          NonFiniteLossError: the streak reached `max_consecutive`.
        """
        self.total += skipped
        self.consecutive = self.consecutive + 1 if skipped else 0
        if skipped:
            log.warning("step %d: %d update(s) skipped for non-finite loss or grads", step, skipped)
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive steps with non-finite loss or gradients "
                f"(trainer.max_consecutive_nan_steps={self.max_consecutive}); last at step {step}"
            )
