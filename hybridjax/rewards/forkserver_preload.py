"""Imported only by the reward workers' forkserver process (`RowScorer`'s
`set_forkserver_preload`), never by the trainer: there, and so in every worker forked from it,
`sys.excepthook` drops the traceback of a worker that was still starting when its pool shut
down (`hybridjax.rewards.scoring.quiet_bootstrap_errors`), unless `HYBRIDJAX_DEBUG=1`."""

import os
import sys

from hybridjax.errors import DEBUG_ENV
from hybridjax.rewards.scoring import quiet_bootstrap_errors

if os.environ.get(DEBUG_ENV, "") in ("", "0"):
    sys.excepthook = quiet_bootstrap_errors
