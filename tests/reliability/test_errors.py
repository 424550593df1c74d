"""The command-line error handler: one short message and exit code 2 for a user error, the
traceback only with HYBRIDJAX_DEBUG=1, a full disk recognised through wrapped errors, and a bug
keeps its traceback."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridjax import errors
from hybridjax.checkpointing.signals import StopRequest
from hybridjax.errors import (
    EXIT_USER_ERROR,
    CheckpointError,
    ConfigError,
    InputFileError,
    MissingFileError,
    cli_errors,
    read_json,
)


def _run(raise_, monkeypatch, capsys, debug=""):
    monkeypatch.setenv("HYBRIDJAX_DEBUG", debug)
    with pytest.raises(SystemExit) as exit_:
        with cli_errors("prog"):
            raise_()
    return exit_.value.code, capsys.readouterr().err


def _raise(err):
    def fn():
        raise err

    return fn


@pytest.mark.parametrize(
    "err", [ConfigError("a.b: bad"), InputFileError("f.parquet, row 3: bad"), CheckpointError("x")]
)
def test_user_error_is_one_line_and_exit_2(err, monkeypatch, capsys):
    code, stderr = _run(_raise(err), monkeypatch, capsys)
    assert code == EXIT_USER_ERROR
    assert stderr == f"prog: error: {err}\n"


def test_debug_switch_adds_the_traceback(monkeypatch, capsys):
    code, stderr = _run(_raise(ConfigError("a.b: bad")), monkeypatch, capsys, debug="1")
    assert code == EXIT_USER_ERROR
    assert "Traceback (most recent call last)" in stderr and stderr.endswith("a.b: bad\n")


def test_disk_full_is_found_inside_wrapped_errors(monkeypatch, capsys):
    def fn():
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/global_step_4")
        except OSError as inner:
            raise RuntimeError("async save failed") from inner

    def leave_now(code):  # the process would end here (os._exit)
        raise SystemExit(code)

    monkeypatch.setattr(errors, "_leave_now", leave_now)
    code, stderr = _run(fn, monkeypatch, capsys)
    assert code == EXIT_USER_ERROR
    assert "disk full (No space left on device" in stderr and "last completed checkpoint" in stderr
    assert "Traceback" not in stderr

    def tensorstore_style():
        raise ValueError("ABORTED: Error writing ...: [OS error 28: No space left on device]")

    assert _run(tensorstore_style, monkeypatch, capsys)[0] == EXIT_USER_ERROR


def test_a_bug_keeps_its_traceback():
    with pytest.raises(ZeroDivisionError):
        with cli_errors("prog"):
            _ = 1 / 0


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    """A second signal leaves at once (os._exit): a checkpoint writer stopped mid-save printed
    its threads' tracebacks at interpreter shutdown ("cannot schedule new futures")."""
    left = []

    def leave_now(code):  # the process would end here (os._exit)
        left.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(errors, "_leave_now", leave_now)
    code, stderr = _run(_raise(KeyboardInterrupt()), monkeypatch, capsys)
    assert code == 130 and stderr == "prog: interrupted\n" and left == [130]


def test_read_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1,\n "b": ,}')
    with pytest.raises(InputFileError, match=rf"{path}: not valid JSON: .* line 2, column 7"):
        read_json(path)
    with pytest.raises(MissingFileError, match="nope.json: no such file"):
        read_json(tmp_path / "nope.json")
    assert isinstance(MissingFileError("x"), FileNotFoundError)


def test_first_signal_requests_a_stop_and_the_second_is_left_to_the_os():
    # what the process had (Python's default, or SIG_IGN when started in a background job)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
        # a second SIGTERM or SIGINT now ends the process at once (default action)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            "--config.actor_rollout_ref.rollout.val_kwarg.n=4",
            "unknown config key 'val_kwarg'; did you mean 'val_kwargs'?",
        ),
        ("--config.trainer.nope=1", "unknown config key 'nope'"),
    ],
)
def test_unknown_key_on_the_command_line_is_one_line(flag, message):
    """A mistyped `--config.a.b` key: one line naming it, exit code 2, no traceback."""
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "hybridjax.train", f"--config={repo}/configs/tiny.py", flag],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != errors.DEBUG_ENV},
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"hybridjax.train: error: in the command line's flags: {message}"
    )
    assert "Traceback" not in out.stderr


def test_a_failed_saves_library_echoes_are_dropped(monkeypatch, capsys):
    """A full disk during a save: TensorStore's callbacks print "Event loop is closed" through
    `sys.excepthook` (a hundred times), orbax logs the failure from its threads; the user sees
    the handler's one line. Other errors and orbax's other lines stay; debug keeps it all."""
    import logging

    orbax_file = os.path.join(os.sep, "x", "orbax", "checkpoint", "async_utils.py")

    def record(message):
        return logging.LogRecord("absl", logging.ERROR, orbax_file, 1, message, None, None)

    def fn():
        sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
        absl = logging.getLogger("absl")
        for message in (
            "[process=0][thread=array_type_handler] _SignalingThread.run() raised an exception",
            "[process=0] Failed to run 4 Handler Commit operations in background save thread",
            "[process=0][step=4][wait_until_finished] Save Finalize thread failed.",
            "orbax: another problem",
        ):
            absl.handle(record(message))
        sys.excepthook(KeyError, KeyError("other"), None)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(errors, "_leave_now", lambda code: sys.exit(code))
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("absl").addHandler(handler)
    try:
        code, stderr = _run(fn, monkeypatch, capsys)
        assert code == EXIT_USER_ERROR
        assert "Event loop is closed" not in stderr and "Finalize" not in stderr
        assert "raised" not in stderr and "background save" not in stderr
        assert "orbax: another problem" in stderr and "KeyError: 'other'" in stderr
        assert stderr.strip().splitlines()[-1].startswith("prog: error: disk full")
        code, stderr = _run(fn, monkeypatch, capsys, debug="1")
        assert "Event loop is closed" in stderr and "Finalize thread" in stderr
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert sys.excepthook is sys.__excepthook__ or "closed_loop" not in repr(sys.excepthook)
