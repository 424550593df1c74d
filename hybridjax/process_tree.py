"""Processes that must not outlive the run: a process's descendants, kept as descendants, and
killed.

A process that forks twice and calls `setsid` (a daemon) leaves its parent's process group and
session: killing a group or a session misses it, and when its parent exits the kernel gives it
to the nearest ancestor marked a *child subreaper* (`prctl(PR_SET_CHILD_SUBREAPER)`, Linux
≥ 3.4, any user, no cgroup needed), or to init, where it runs on after the run. So:

  * every worker process that runs user code (reward functions, `hybridjax.rewards.scoring`;
    tools, `hybridjax.tools.executor`) calls `keep_descendants()` as it starts: it becomes a
    subreaper, so whatever the user's code starts stays in its tree however it detaches (the
    worker reaps those that exited after each call, `reap_exited_children`), and when the
    worker exits (its pool stopping it, a call's timeout, the end of the run) it kills
    that tree;
  * the workers' forkserver is a subreaper too (`hybridjax.rewards.forkserver_preload`): the
    orphans of a worker that died without clean-up (SIGKILL, a crash) stay in its tree, and the
    process that owns the pools kills the forkserver's whole tree when it exits
    (`kill_forkserver_tree_at_exit`).

Not covered: the owning process itself killed with SIGKILL (nothing runs in it; a run cgroup,
as the python sandbox's `RunCgroup`, would be needed), and a process the worker may not signal
(a setuid program started by an unprivileged user).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.util
import os
import signal

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
# Imported by the workers' forkserver as it starts (named, not imported here: they sit above
# this module): the reward scoring module, so that replacement workers start in ms, not in the
# ~0.5 s of a fresh import, and the module that makes the forkserver a subreaper.
SCORING = "hybridjax.rewards.scoring"
PRELOAD = "hybridjax.rewards.forkserver_preload"
_ROUNDS = 1000  # stop passes; each catches the children forked before their parent stopped
_registered = False


def descendants(root: int) -> list[int]:
    """`root` (first) and its descendants (through /proc/<pid>/task/<tid>/children, or the
    parent pids of every process where the kernel lacks CONFIG_PROC_CHILDREN). Processes that
    exit meanwhile may be listed or not."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants_by_parents(root)
    pids, i = [root], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pids[i]}/task"):
                with open(f"/proc/{pids[i]}/task/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
        i += 1
    return pids


def _descendants_by_parents(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{name}/stat") as f:
            children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
    pids, i = [root], 0
    while i < len(pids):
        pids += children.get(pids[i], [])
        i += 1
    return pids


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a process killed and not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def become_subreaper() -> bool:
    """Marks this process a child subreaper (orphaned descendants come back to it, not to
    init). Returns False where the kernel or the platform has no such thing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def kill_descendants(root: int, include_root: bool = False) -> int:
    """Kills every running descendant of `root` (and `root` itself when `include_root`):
    SIGSTOP pass after pass until the tree holds no running process that is not stopped (a
    stopped process cannot fork, so this ends; at most `_ROUNDS` passes), then SIGKILL to
    each. Returns how many processes were killed."""
    frozen: dict[int, None] = {}  # in the order stopped
    for _ in range(_ROUNDS):
        pids = descendants(root)
        live = [p for p in (pids if include_root else pids[1:]) if p not in frozen and running(p)]
        if not live:
            break
        for pid in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                frozen[pid] = None
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(frozen)


def keep_descendants() -> None:
    """Called in a worker process as it starts: makes it a subreaper and kills its descendants
    when it exits through multiprocessing's exit path (its end, or SIGTERM from its pool: pebble
    stops a worker, and one whose call timed out, that way first). A process the user's code
    forks inherits the registration but does not run it (it is not the worker)."""
    become_subreaper()
    worker = os.getpid()

    def _kill_own() -> None:
        if os.getpid() == worker:
            # pebble's SIGTERM (its pool stopping) would `os._exit` in the middle, leaving
            # processes stopped and not yet killed; the worker is leaving anyway
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            kill_descendants(worker)

    multiprocessing.util.Finalize(None, _kill_own, exitpriority=100)


def reap_exited_children() -> int:
    """Reaps every child of this process that has exited (without blocking); returns how
    many. A subreaper inherits the orphans of its tree: each would stay a zombie (a pid of the
    user's) until it exits. A child the user's code still means to wait for then reads exit
    code 0 (Python's `subprocess` takes a child already reaped as exited with 0)."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


def worker_context() -> multiprocessing.context.BaseContext:
    """The `forkserver` context of the worker processes that run user code (reward functions,
    tools). Its server preloads `SCORING` and `PRELOAD` if it is not yet running (a server
    some other code started keeps its own preloads), and the calling process kills the
    server's tree when it exits (`kill_forkserver_tree_at_exit`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", SCORING, PRELOAD])  # no effect once it runs
    kill_forkserver_tree_at_exit()
    return context


def kill_forkserver_tree_at_exit() -> None:
    """Registers (once per process) an exit handler that kills multiprocessing's forkserver of
    this process and all its descendants: its workers and the orphans of workers that died
    without clean-up. The forkserver would leave at exit anyway, but not while a daemon holds
    the pipe that tells it its owner is gone (every worker inherits it)."""
    global _registered
    if _registered:
        return
    _registered = True
    owner = os.getpid()

    def _kill() -> None:
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        if os.getpid() == owner and server is not None:
            kill_descendants(server, include_root=True)

    atexit.register(_kill)
