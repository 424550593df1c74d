"""A quiet console for the entry points: the progress bar and one compact line per step
(`Tracking`), events that change the run (`announce`: resumed from step N, a lock taken
over, a run stopped by a guard), warnings and errors; everything logged at INFO (the rollout
engine's compiles, page-pool sizing, orbax's checkpoint steps) goes to the run's log file
instead.

`--verbosity` (absl's flag, `-v`) brings them back: `--verbosity=0` shows INFO on the console,
`--verbosity=1` DEBUG; the default (-1) is WARNING. Console lines are written through
`tqdm.write`, so a warning never tears the progress bar.
"""

from __future__ import annotations

import logging
import os
import sys

import tqdm
from absl import flags
from absl import logging as absl_logging
from absl.logging import converter

NOTICE = 25  # between INFO and WARNING: an event that changes the run, always on the console
logging.addLevelName(NOTICE, "NOTICE")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _TqdmHandler(logging.Handler):
    """Writes records to stderr with `tqdm.write` (above any progress bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 (logging must never raise)
            self.handleError(record)


class _RunLogFile(logging.FileHandler):
    """The run's log file, created (with its directory) at the first record; a type of its
    own, so a second `configure_logging` replaces it."""

    def __init__(self, path: str):
        super().__init__(path, encoding="utf-8", delay=True)

    def _open(self):
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()


def announce(logger: logging.Logger, message: str) -> None:
    """Logs an event that changes the run (resumed from a step, a lock taken over, a run
    stopped by a guard) at `NOTICE`: shown on the quiet console as well as in the log file."""
    logger.log(NOTICE, message)


def console_level() -> int:
    """The console's logging level: absl's `--verbosity` when given on the command line, else
    WARNING (absl's `app.run` defaults the flag to 0, INFO, which is what we keep off the
    console)."""
    flag = flags.FLAGS["verbosity"]
    return converter.absl_to_standard(flag.value) if flag.present else logging.WARNING


def configure_logging(log_file: str | None, level: int | None = None) -> None:
    """Routes logging for a run: records at `level` (default `console_level()`) and above to
    the console, INFO and above to `log_file` (appended; it and its directory are created at
    the first record; None: no file). Replaces the root logger's console handlers (absl's
    included), so calling it twice does not duplicate lines."""
    level = console_level() if level is None else level
    root = logging.getLogger()
    for handler in list(root.handlers):
        ours = isinstance(handler, _TqdmHandler | _RunLogFile)
        if ours or handler is absl_logging.get_absl_handler():
            root.removeHandler(handler)
            if isinstance(handler, _RunLogFile):
                handler.close()
    root.setLevel(min(level, logging.INFO))
    for name in ("hybridjax", "absl"):  # set by earlier code or absl's flag parsing
        logging.getLogger(name).setLevel(logging.NOTSET)
    console = _TqdmHandler(min(level, NOTICE))  # events (`announce`) show at any verbosity
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    root.addHandler(console)
    if log_file:
        file_handler = _RunLogFile(log_file)
        file_handler.setLevel(min(level, logging.INFO))
        file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(file_handler)
