"""Recycled pytest-xdist workers for the slow suite (`--recycle-workers-after=SECONDS`).

`--dist loadfile` keeps a test file on one worker, so its module fixtures are built once; with
this option a worker also takes one file at a time, and once it has run for SECONDS it finishes
its file, exits, and a fresh worker (a new process: imports, collection, 20-30 s) takes the next
file. Compiled XLA programs therefore never pile up in one process for longer than that (the
slow suite in one process segfaulted inside XLA:CPU's compiler and serializer after 25 minutes,
when its programs' memory maps reached `vm.max_map_count`: experiments/xla_memory_maps.py), and 0
gives every file a process of its own.

A worker that dies (a signal, `os._exit`) fails the test it was running, with the signal in the
report ("worker 'gw1' crashed while running 'tests/x.py::test_y' (killed by SIGSEGV)"); the rest
of its file goes to another worker and the run goes on, up to `--max-worker-restart` deaths.
xdist's own `loadfile` would run the crashed test a second time; here it is not rerun.

Uses two private parts of pytest-xdist 3.x (`DSession._clone_node`, which xdist itself calls to
replace a crashed worker, and execnet's process handle, only to name the signal); the
subprocess test in `tests/test_ci.py` fails if either changes.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--recycle-workers-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with -n N --dist loadfile: a worker takes one file at a time and is replaced by "
        "a fresh process after the file during which it reached SECONDS of life (0: each file)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # a worker: the controller checked
    if _recycle_after(config) is not None and config.getoption("dist", "no") != "loadfile":
        raise pytest.UsageError("--recycle-workers-after needs -n N --dist loadfile")


def _recycle_after(config: pytest.Config) -> float | None:
    seconds: float | None = config.getoption("recycle_workers_after", None)
    return seconds


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    recycle_after = _recycle_after(config)
    if recycle_after is None:
        return None
    seconds: float = recycle_after
    from xdist.scheduler import LoadFileScheduling

    class RecyclingFileScheduling(LoadFileScheduling):
        """One file at a time per worker; a worker past its lifetime is shut down between files."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.born: dict[Any, float] = {}

        def add_node(self, node: Any) -> None:
            super().add_node(node)
            self.born[node] = time.monotonic()

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down or node not in self.registered_collections:
                return  # (a new worker still collecting is scheduled when it is done)
            if not self.workqueue:
                node.shutdown()
                return
            # the worker holds back its file's last test until it is sent more work (the next
            # test decides the fixtures' teardown), so 1 pending test means the file is done
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            if time.monotonic() - self.born[node] >= seconds and self.assigned_work[node]:
                node.shutdown()  # runs its last test, exits; pytest_testnodedown replaces it
                return
            self._assign_work_unit(node)

        def remove_node(self, node: Any) -> str | None:
            workload = self.assigned_work.pop(node)
            crashitem = next(
                (nodeid for unit in workload.values() for nodeid, done in unit.items() if not done),
                None,
            )
            if crashitem is None:
                return None
            workload[self._split_scope(crashitem)][crashitem] = True  # fails, not rerun
            self.workqueue.update((s, u) for s, u in workload.items() if not all(u.values()))
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

    return RecyclingFileScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """A worker retired between files (no error) exits now and is replaced while files remain
    (xdist would keep a finished worker's process, and its memory, until the whole run ends)."""
    config = node.config
    if error is not None or _recycle_after(config) is None:
        return  # a crashed worker: xdist replaces it itself, within --max-worker-restart
    node.ensure_teardown()  # closes its channel: the process exits
    _reap(node)
    dsession = config.pluginmanager.getplugin("dsession")
    if dsession.sched.workqueue and not dsession.shuttingdown:
        dsession._clone_node(node)


def _reap(node: Any) -> None:
    """Waits for a retired worker's process in a daemon thread, so that it does not stay a
    zombie until the run ends (a slow-suite run retires a dozen or more)."""
    popen = _popen(node)
    if popen is not None:
        threading.Thread(target=popen.wait, daemon=True).start()


def _popen(node: Any) -> Any:
    """The worker's process handle (execnet's `subprocess.Popen`), or None if not reachable."""
    return getattr(getattr(node.gateway, "_io", None), "popen", None)


def _exit_signal(node: Any) -> str:
    """'killed by SIGSEGV' from the worker process's exit status, or '' if unknown."""
    popen = _popen(node)
    try:
        returncode = popen.wait(timeout=10)
    except Exception:  # (None: no handle)
        return ""
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    cause = _exit_signal(report.node)  # type: ignore[attr-defined]
    if cause:
        report.longrepr = f"{report.longrepr} ({cause})"
