"""The failure guard of the `reward` stage: a reward function or server that fails on most rows
cannot silently train the policy on zeros.

Whatever `reward_model.on_error` says, a training step in which more than half of the rows'
rewards failed (`reward/num_errors` + `reward/num_timeouts` + `reward/num_nonfinite`, a served
reward model's included) is a *failed step*: it is never checkpointed (the trainer skips
its save, and says so on the console), and `reward_model.max_consecutive_failed_steps` failed
steps in a row stop the run with `RewardFailureError`, before any checkpoint is saved from
them. A step in which most rows scored resets the count. (The first batch has a stricter rule
of its own: every row failing stops at once, `hybridjax.rewards.manager.check_outcomes`.)
"""

from __future__ import annotations

import dataclasses
import logging

from hybridjax.errors import UserError
from hybridjax.metrics.console import announce
from hybridjax.rewards.manager import RewardResult

log = logging.getLogger(__name__)
FAILURE_METRICS = ("reward/num_errors", "reward/num_timeouts", "reward/num_nonfinite")
KEY = "reward_model.max_consecutive_failed_steps"


class RewardFailureError(UserError, RuntimeError):
    """Too many consecutive steps in which most rows' rewards failed (names the steps, the
    counts and the first error)."""


@dataclasses.dataclass
class RewardFailureGuard:
    """Counts consecutive failed steps (`max_consecutive`: the config key `KEY`)."""

    max_consecutive: int
    consecutive: int = 0
    first_failed_step: int = 0

    @classmethod
    def from_config(cls, cfg) -> RewardFailureGuard:
        return cls(int(cfg.reward_model.max_consecutive_failed_steps))

    def count(self, result: RewardResult | None, step: int) -> None:
        """Records step `step`'s rewards (None: a pipeline without a reward stage).

        Raises:
          RewardFailureError: this step is the `max_consecutive`-th failed one in a row.
        """
        if result is None:
            return
        rows = len(result.scores)
        failed = min(rows, int(sum(result.metrics.get(k, 0.0) for k in FAILURE_METRICS)))
        if rows == 0 or 2 * failed <= rows:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.consecutive == 1:
            self.first_failed_step = step
        counts = ", ".join(f"{k.split('/num_')[1]} {result.metrics.get(k, 0.0):g}" for k in
                           FAILURE_METRICS)  # fmt: skip
        what = f"{failed} of {rows} rows' rewards failed at step {step} ({counts}); the first: "
        what += result.first_error or "(no message)"
        if self.consecutive >= self.max_consecutive:
            raise RewardFailureError(
                f"{what}. Steps {self.first_failed_step}-{step}: most rows failed in "
                f"{self.consecutive} consecutive steps ({KEY}={self.max_consecutive}); stopped "
                "before saving a checkpoint from them (the last checkpoint is kept: fix the "
                "reward function or server and run the same command to resume)"
            )
        announce(log, f"{what}; step {step} is not checkpointed ({self.consecutive} of "
                      f"{KEY}={self.max_consecutive})")  # fmt: skip

    def may_save(self) -> bool:
        """Whether the last counted step may be checkpointed (it did not fail)."""
        return self.consecutive == 0
