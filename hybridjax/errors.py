"""Errors a user causes or can fix, and the one handler that reports them at the command line.

Every such error is a `UserError`: its message says what is wrong, where (file, row, column or
config key) and the valid choices. The entry points (`python -m hybridjax.train`, `python -m
hybridjax.sft`) run under `cli_errors()`, which turns a `UserError` (and a full disk, and a
second Ctrl-C) into that message on stderr and a non-zero exit code, without a traceback. Set
`HYBRIDJAX_DEBUG=1` to get the traceback as well. Anything else is a bug and keeps its traceback.

Each class also derives from the builtin exception a caller would catch before (`ValueError`,
`FileNotFoundError`, ...), so library code that catches those keeps working.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

DEBUG_ENV = "HYBRIDJAX_DEBUG"
EXIT_USER_ERROR = 2  # absl's flag errors exit with 1; a bad input exits with 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class UserError(Exception):
    """A problem with the user's input, files or environment; the message is complete."""


class ConfigError(UserError, ValueError):
    """A config has problems; the message lists each one as `key: problem (value)`."""


class InputFileError(UserError, ValueError):
    """A data, model or tokenizer file that is missing, unreadable or malformed (names it)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the run needs does not exist (names the path)."""


def read_json(path) -> Any:
    """The parsed JSON file `path`.

    Raises:
      MissingFileError: no such file.
      InputFileError: not valid JSON or not UTF-8 (names the path, line and column).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as err:
        raise MissingFileError(f"{path}: no such file") from err
    except json.JSONDecodeError as err:
        raise InputFileError(
            f"{path}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        ) from err
    except UnicodeDecodeError as err:
        raise InputFileError(f"{path}: not UTF-8 text (byte {err.start})") from err


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used as asked (missing step, does not match the config)."""


class ExportError(UserError, ValueError):
    """An export target that would lose files (not empty without `--overwrite`, a file)."""


def _disk_full(err: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT `OSError` in `err`'s cause chain, if any (orbax and TensorStore wrap
    the writer's error in their own)."""
    seen = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        err = cause
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return err
        text = str(err)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return OSError(errno.ENOSPC, text.splitlines()[0] if text else "disk full")
        cause = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def cli_errors(program: str) -> Iterator[None]:
    """Runs a command-line entry point: a `UserError` or a full disk ends the process with a
    short message on stderr and exit code 2; Ctrl-C with exit code 130. Tracebacks only when
    `HYBRIDJAX_DEBUG=1` (libraries' echoes of a failed save included). Other exceptions
    propagate (a bug: the traceback is wanted)."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    quiet = _NoLibraryTracebacks()
    hook = sys.excepthook
    if not debug:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
        sys.excepthook = _no_closed_loop_tracebacks(hook)
    try:
        yield
    except UserError as err:
        if debug:
            traceback.print_exc()
        _exit(f"{program}: error: {err}", EXIT_USER_ERROR)
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: stop at once
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        print(f"{program}: interrupted", file=sys.stderr, flush=True)
        # leave now: the checkpoint writer's threads, stopped in the middle of a save, would
        # print their tracebacks at interpreter shutdown (the last completed checkpoint is
        # kept); the log is flushed and what was registered with `before_leaving` (the run
        # locks' records) runs first
        for handler in logging.getLogger().handlers:  # the console and the run's log file
            handler.flush()
        for release in _BEFORE_LEAVING:
            release()
        _leave_now(EXIT_INTERRUPTED)
    except Exception as err:
        full = _disk_full(err)
        if full is None:
            raise
        if debug:
            traceback.print_exc()
        where = re.search(r'"(/[^"]+)"', str(full))
        print(
            f"{program}: error: disk full (No space left on device"
            f"{' writing ' + where.group(1) if where else ''}). The last completed checkpoint is "
            "kept; free space and run again to resume.",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # every `finally` has run; leave now, so the writer's abandoned asyncio tasks do not
        # print their tracebacks after this message at interpreter shutdown
        _leave_now(EXIT_USER_ERROR)
    finally:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        sys.excepthook = hook


QUIET_LOGGERS = ("absl", "asyncio")  # orbax logs through absl; its writer's tasks via asyncio


# what orbax logs (at ERROR, from its threads) when a background save fails; the failure itself
# is raised in the main thread (`Checkpointer.save` or `wait`) and reported by `cli_errors`
_FAILED_SAVE = ("_SignalingThread.run() raised", "background save thread", "Finalize thread")


class _NoLibraryTracebacks(logging.Filter):
    """Drops the traceback orbax (or its asyncio tasks) log with a failed background save, and
    orbax's own lines about it (the error itself is raised to `cli_errors`, which reports it in
    one line); its other lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        library = f"{os.sep}orbax{os.sep}" in record.pathname or record.name == "asyncio"
        if not library:
            return True
        if record.levelno >= logging.ERROR and any(
            text in record.getMessage() for text in _FAILED_SAVE
        ):
            return False
        if record.exc_info:
            record.exc_info = None
            record.exc_text = None
        return True


def _no_closed_loop_tracebacks(hook: Callable[..., Any]) -> Callable[..., None]:
    """`sys.excepthook` without the "Event loop is closed" tracebacks that TensorStore's
    callbacks print (one per pending write, a hundred and more) when a save fails and orbax
    has closed its event loop; every other error goes to `hook`."""

    def excepthook(kind, value, tb) -> None:
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        hook(kind, value, tb)

    return excepthook


_BEFORE_LEAVING: list[Callable[[], None]] = []


def before_leaving(release: Callable[[], None]) -> None:
    """Registers `release` (no arguments) to run when a second Ctrl-C or SIGTERM makes
    `cli_errors` leave the process at once, which skips `atexit` (e.g. the run locks' records,
    `hybridjax.checkpointing.run_lock`). Registering the same function twice runs it once."""
    if release not in _BEFORE_LEAVING:
        _BEFORE_LEAVING.append(release)


def _leave_now(code: int) -> None:
    os._exit(code)


def _exit(message: str, code: int) -> None:
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_main(main: Callable[[list[str]], None], program: str) -> None:
    """`absl.app.run(main)`, with a mistake in the command line's flags (an unknown
    `--config.a.b` key, a value of the wrong type) reported in one line, exit code 2, instead of
    the config library's traceback (kept with `HYBRIDJAX_DEBUG=1`)."""
    from absl import app, flags

    try:
        app.run(main)
    except Exception as err:  # noqa: BLE001 - only errors of flag parsing are handled here
        if flags.FLAGS.is_parsed() or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        missing = isinstance(err, KeyError | AttributeError)  # ml_collections' unknown key
        text = err.args[0] if missing and err.args else str(err)
        text = str(text).replace("\\n", " ").replace("\\'", "'").strip("'\"")
        text = " ".join(text.split())
        if missing:
            m = re.search(r"(\w+)'? Did you mean \"(\w+)\"", text)
            text = f"unknown config key {m[1] if m else text!r}" + (
                f"; did you mean {m[2]!r}?" if m else ""
            )
        _exit(f"{program}: error: in the command line's flags: {text}", EXIT_USER_ERROR)
