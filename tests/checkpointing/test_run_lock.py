"""One run owns its directory: a second holder is refused with the first one named, a lock
left by a killed process is taken over (and announced), and a directory that cannot be
written is reported before anything else happens."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from hybridjax.checkpointing.run_lock import (
    DirectoryInUseError,
    DirectoryNotWritableError,
    hold,
    hold_outputs,
    lock_path,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _holder(directory, then: str = "import time; time.sleep(60)") -> subprocess.Popen:
    """Another process holding `directory`; prints "held" once it does."""
    code = textwrap.dedent(f"""
        from hybridjax.checkpointing.run_lock import hold
        hold({str(directory)!r}, "trainer.default_local_dir")
        print("held", flush=True)
        {then}
    """)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_with_the_first_named(tmp_path):
    run = tmp_path / "run"
    other = _holder(run)
    try:
        with pytest.raises(DirectoryInUseError) as err:
            hold(str(run), "trainer.default_local_dir")
        message = str(err.value)
        assert f"trainer.default_local_dir: {run} is in use by another run" in message
        assert f"pid {other.pid} on host {socket.gethostname()}, started 20" in message
        assert os.listdir(run) == []  # nothing written into the run directory
    finally:
        other.kill()
        other.wait()


def test_a_killed_holders_lock_is_taken_over_and_announced(tmp_path, caplog):
    run = tmp_path / "run"
    other = _holder(run)
    other.send_signal(signal.SIGKILL)
    other.wait()
    with caplog.at_level(logging.INFO), hold(str(run), "trainer.default_local_dir"):
        pass
    (record,) = [r for r in caplog.records if "took over" in r.message]
    assert record.levelname == "NOTICE"
    assert f"from pid {other.pid} on host {socket.gethostname()}" in record.message
    assert f"pid {other.pid} is no longer running" in record.message


def test_released_on_exit_and_reentrant_in_one_process(tmp_path):
    run = tmp_path / "run"
    _holder(run, then="").wait()  # exits normally: released, record emptied
    assert open(lock_path(str(run))).read() == ""
    first = hold(str(run), "k")
    second = hold(str(run), "k")  # the command line and the trainer it builds
    second.release()
    assert _try_hold(run).returncode != 0  # still held by `first`
    first.release()
    assert _try_hold(run).returncode == 0


def test_a_second_interrupt_empties_the_record_before_leaving(tmp_path):
    # a second Ctrl-C leaves with os._exit, which skips atexit: the lock registers its release
    code = textwrap.dedent(f"""
        import os
        from hybridjax import errors
        from hybridjax.checkpointing.run_lock import hold
        errors._leave_now = lambda code: os._exit(code)
        with errors.cli_errors("prog"):
            hold({str(tmp_path / "run")!r}, "k")
            raise KeyboardInterrupt
    """)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 130 and run.stderr == "prog: interrupted\n", run.stderr
    assert open(lock_path(str(tmp_path / "run"))).read() == ""


def _try_hold(directory) -> subprocess.CompletedProcess:
    code = f"from hybridjax.checkpointing.run_lock import hold; hold({str(directory)!r}, 'k')"
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)


def test_offline_trainers_hold_the_run_and_the_export_target(tmp_path):
    run, export = tmp_path / "run", tmp_path / "out" / "hf"
    locks = hold_outputs(str(run), str(export))
    assert os.path.isdir(run) and not export.exists() and os.path.isdir(export.parent)
    code = (
        "from hybridjax.checkpointing.run_lock import hold_outputs\n"
        f"hold_outputs({str(tmp_path / 'other')!r}, {str(export)!r})"
    )
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert f"trainer.output_dir: {export} is in use by another run" in out.stderr
    for lock in locks:
        lock.release()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_read_only_directory_is_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    code = (
        "from hybridjax.checkpointing.run_lock import hold\n"
        f"hold({str(run)!r}, 'trainer.default_local_dir')"
    )
    # paths as arguments, not in the line: the interpreter or tmp may have spaces in their path
    script = 'mount --bind -o ro "$1" "$1" && exec "$2" -c "$3"'
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", script, "sh", str(tmp_path), sys.executable, code],
        capture_output=True,
        text=True,
        env=env,
    )
    if "mount" in out.stderr and "DirectoryNotWritable" not in out.stderr:
        pytest.skip(f"no private read-only mount here: {out.stderr.strip()}")
    assert DirectoryNotWritableError.__name__ in out.stderr
    assert f"trainer.default_local_dir: cannot write to {run}: Read-only file system" in out.stderr
