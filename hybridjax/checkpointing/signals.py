"""SIGTERM / SIGINT turned into a request to checkpoint and stop at the end of the step."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class StopRequest:
    """While entered, the first SIGTERM or SIGINT sets `requested` instead of killing the process.

    The trainer checks `requested` between steps, saves a checkpoint and returns. The first
    signal also puts both signals back to the operating system's default action, so a second
    one ends the process at once, even inside a long device call, without a traceback. The last
    completed checkpoint stays loadable (orbax commits a checkpoint with one rename; a save cut
    short leaves only its temporary directory). Handlers are only installed from the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        log.warning(
            "%s received: saving a checkpoint after this step (send it again to stop at once; "
            "the last completed checkpoint is kept)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
