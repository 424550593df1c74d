"""Imported only by the workers' forkserver process (`worker_context`'s
`set_forkserver_preload`), never by the trainer: there, and so in every worker forked from it,
`sys.excepthook` drops the traceback of a worker that was still starting when its pool shut
down (`hybridjax.rewards.scoring.quiet_bootstrap_errors`), unless `HYBRIDJAX_DEBUG=1`. The
forkserver is also a child subreaper (`hybridjax.process_tree`): the orphans of a worker that
died without clean-up come to it (it reaps them, so its warning about a pid it did not fork is
silenced), and the trainer kills its tree when it exits."""

import os
import sys
import warnings

from hybridjax.errors import DEBUG_ENV
from hybridjax.process_tree import become_subreaper
from hybridjax.rewards.scoring import quiet_bootstrap_errors

become_subreaper()
warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")

if os.environ.get(DEBUG_ENV, "") in ("", "0"):
    sys.excepthook = quiet_bootstrap_errors
