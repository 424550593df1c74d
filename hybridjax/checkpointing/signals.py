"""SIGTERM / SIGINT turned into a request to checkpoint and stop at the end of the step."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class StopRequest:
    """While entered, SIGTERM and SIGINT set `requested` instead of killing the process.

    The trainer checks `requested` between steps, saves a checkpoint and returns. A second
    SIGINT raises KeyboardInterrupt as usual. Handlers are only installed from the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s received: saving a checkpoint after this step", signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
