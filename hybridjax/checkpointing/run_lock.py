"""One run owns its directory: an exclusive lock taken before anything is written there.

The lock of a directory `<parent>/<name>` is the file `<parent>/.<name>.lock` (beside it, so the
directory's own listing is unchanged and an HF export can still be renamed into place), held
with `fcntl.flock` for as long as the process holds the directory. The file records the
holder, `{"pid", "host", "started"}` (start time, UTC ISO 8601), so that a second trainer on
the same directory stops with a message naming it. The kernel releases a flock when its
process dies, however it dies; a file that still names another holder when the lock is
free is therefore stale (a run that was killed): it is taken over, and the take-over is
announced on the console. On release (and at a normal exit) the record is emptied, never deleted
(deleting a lock file races with a process that has just opened it).

A process may hold the same directory several times (the command line and the trainer it
builds); it is released with the last `release()`.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import threading

from hybridjax.errors import UserError, before_leaving
from hybridjax.metrics.console import announce

log = logging.getLogger(__name__)


class DirectoryInUseError(UserError, RuntimeError):
    """Another live process holds the directory (the message names its pid, host, start)."""


class DirectoryNotWritableError(UserError, PermissionError):
    """The directory (or the place of its lock) cannot be written (names it and why)."""


@dataclasses.dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


_HELD: dict[str, tuple[int, int]] = {}  # real path -> (lock fd, times held)
_GUARD = threading.Lock()


def lock_path(directory: str) -> str:
    """`<parent>/.<name>.lock` of a directory."""
    path = os.path.realpath(os.path.abspath(directory.rstrip("/") or "/"))
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.lock")


@dataclasses.dataclass
class RunDirectoryLock:
    """A held directory (`hold(...)`); `release()` once, or use it as a context manager."""

    directory: str
    path: str
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        with _GUARD:
            fd, count = _HELD[self.path]
            if count > 1:
                _HELD[self.path] = (fd, count - 1)
                return
            del _HELD[self.path]
            os.ftruncate(fd, 0)
            os.close(fd)  # releases the flock

    def __enter__(self) -> RunDirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold(directory: str, key: str, create: bool = True) -> RunDirectoryLock:
    """Takes the lock of `directory` for this process, and checks that the directory (with
    `create`: created if missing) or else its parent can be written.

    Args:
      directory: the run's output directory, or an export target (`create=False`: an export
        renames its files into place, so only the parent is created).
      key: the config key or flag that names it, for the messages.

    Raises:
      DirectoryInUseError: another live process holds it (pid, host and start time named).
      DirectoryNotWritableError: the directory or its lock file cannot be written.
    """
    path = lock_path(directory)
    with _GUARD:
        if path in _HELD:
            fd, count = _HELD[path]
            _HELD[path] = (fd, count + 1)
            return RunDirectoryLock(directory, path)
        writable = directory if create else os.path.dirname(path)
        fd = _open(path, key, writable)
        previous = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUseError(_in_use(key, directory, path, previous)) from None
        except OSError:  # no flock here (some network file systems): the record decides
            if previous is not None and not _stale(previous):
                os.close(fd)
                raise DirectoryInUseError(_in_use(key, directory, path, previous)) from None
        if previous is not None and previous.pid != os.getpid():
            announce(
                log,
                f"took over the lock of {directory} from {previous.describe()} "
                f"({_why_stale(previous)})",
            )
        _write(fd, Holder(os.getpid(), socket.gethostname(), _now()))
        if not _HELD:
            atexit.register(release_all)  # a normal exit empties the record; a kill cannot
            before_leaving(release_all)  # and so does a second Ctrl-C, which skips atexit
        _HELD[path] = (fd, 1)
    lock = RunDirectoryLock(directory, path)
    try:
        _check_writable(writable, key)
    except DirectoryNotWritableError:
        lock.release()
        raise
    return lock


def release_all() -> None:
    """Releases every directory this process holds, emptying their records (at exit)."""
    with _GUARD:
        for fd, _ in _HELD.values():
            os.ftruncate(fd, 0)
            os.close(fd)
        _HELD.clear()


def _in_use(key: str, directory: str, path: str, holder: Holder | None) -> str:
    who = holder.describe() if holder else "another process"
    return (
        f"{key}: {directory} is in use by another run ({who}); stop that run, or choose "
        f"another directory (lock file {path})"
    )


def _stale(holder: Holder) -> bool:
    """Without flock: a record of a dead pid on this host is stale; any other is not."""
    return holder.host == socket.gethostname() and not _alive(holder.pid)


def _open(path: str, key: str, directory: str) -> int:
    try:
        os.makedirs(directory, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise DirectoryNotWritableError(_not_writable(key, directory, err)) from err


def _check_writable(directory: str, key: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise DirectoryNotWritableError(_not_writable(key, directory, err)) from err


def _not_writable(key: str, directory: str, err: OSError) -> str:
    why = err.strerror or str(err)
    hint = " (a read-only file system)" if err.errno == errno.EROFS else ""
    return f"{key}: cannot write to {directory}: {why}{hint}; choose a writable directory"


def _read(fd: int) -> Holder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 4096)
    try:
        record = json.loads(data)
        return Holder(int(record["pid"]), str(record["host"]), str(record["started"]))
    except (ValueError, KeyError, TypeError):
        return None


def _write(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(dataclasses.asdict(holder)).encode())
    os.fsync(fd)


def _why_stale(holder: Holder) -> str:
    if holder.host != socket.gethostname():
        return f"its lock was released; host {holder.host} is not this one"
    if not _alive(holder.pid):
        return f"pid {holder.pid} is no longer running"
    return f"pid {holder.pid} no longer holds the lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def hold_outputs(run_dir: str, export_dir: str = "") -> list[RunDirectoryLock]:
    """Holds an offline trainer's directories on process 0 (`trainer.default_local_dir` and,
    when given, the HF export target `trainer.output_dir`) until released or the process
    exits; other processes hold nothing. Raises as `hold`."""
    import jax

    if jax.process_index() != 0:
        return []
    locks = [hold(run_dir, "trainer.default_local_dir")]
    if export_dir:
        locks.append(hold(export_dir, "trainer.output_dir", create=False))
    return locks


def hold_run_directory(cfg) -> RunDirectoryLock:
    """Holds an RL run's `trainer.default_local_dir` (a trainer ConfigDict). Raises as `hold`."""
    return hold(cfg.trainer.default_local_dir, "trainer.default_local_dir")
