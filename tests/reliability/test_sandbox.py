"""Model-written code against the Python sandbox: each case is an escape a policy under RL can
find by itself (reading or deleting the run's files, outliving the timeout, reaching the
network, exhausting the host), and must fail inside the sandbox."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from hybridjax.tools.sandbox import PythonTool, SandboxUnavailable, run_python

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
MARK = "1000.31415"  # argv of the processes the escape cases leave behind, if any


def _leftovers() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARK.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _fails(code: str, expect: str, **kw) -> None:
    rc, out, err = run_python(code, **kw)
    assert rc != 0 and expect in err, (rc, out, err[-400:])


@needs_bwrap
@pytest.mark.parametrize(
    "code, expect",
    [
        ("print(open('/etc/passwd').read())", "FileNotFoundError"),
        ("print(open('/proc/1/root/etc/passwd').read())", "Error"),
        ("import os; print(os.listdir(os.path.expanduser('~root')))", "Error"),
        ("open('/usr/pwned', 'w')", "Read-only file system"),
        ("import sys; open(sys.prefix + '/pwned', 'w')", "Read-only file system"),
        (
            "import socket, importlib; importlib.reload(socket); "
            "socket.create_connection(('1.1.1.1', 80), timeout=2)",
            "Network is unreachable",
        ),
        ("import socket; socket.getaddrinfo('example.com', 80)", "gaierror"),
        ("x = bytearray(1 << 30)", "MemoryError"),
        ("open('big', 'wb').write(b'x' * (64 << 20))", "File too large"),
        ("fs = [open('/dev/null') for _ in range(1000)]", "Too many open files"),
        (f"import os; os.kill({os.getpid()}, 9)", "ProcessLookupError"),  # this test's pid
    ],
    ids=[
        "read-etc",
        "read-via-proc-root",
        "list-home",
        "write-system",
        "write-interpreter",
        "network-after-reload",
        "dns",
        "memory",
        "file-size",
        "open-files",
        "kill-outside",
    ],
)
def test_escape_attempts_fail_inside(code, expect):
    _fails(code, expect)


@needs_bwrap
def test_run_directory_is_neither_readable_nor_deletable(tmp_path):
    run = tmp_path / "run" / "global_step_1"
    run.mkdir(parents=True)
    (run / "state").write_text("weights")
    code = f"import shutil; shutil.rmtree({str(tmp_path)!r})"
    _fails(code, "FileNotFoundError")
    assert (run / "state").read_text() == "weights"


@needs_bwrap
def test_sees_only_its_own_processes_and_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDJAX_REWARD_TOKEN", "secret")
    code = (
        "import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]), dict(os.environ))"
    )
    rc, out, _ = run_python(code)
    count, env = out.split(" ", 1)
    assert rc == 0 and int(count) <= 3 and "secret" not in env and "HYBRIDJAX" not in env


@needs_bwrap
@pytest.mark.parametrize("detach", ["children", "new-session", "double-fork"])
def test_no_process_outlives_the_timeout(detach):
    spawn = {
        "children": f"[subprocess.Popen(['sleep', '{MARK}']) for _ in range(50)]",
        "new-session": f"subprocess.Popen(['sleep', '{MARK}'], start_new_session=True)",
        "double-fork": (
            f"os.fork() or (os.setsid(), os.fork() or os.execvp('sleep', ['sleep', '{MARK}']))"
        ),
    }[detach]
    code = f"import os, subprocess, time\n{spawn}\ntime.sleep(100)"
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_python(code, timeout_s=1.5)
    assert time.monotonic() - start < 5
    for _ in range(20):  # the kernel reaps the namespace's processes asynchronously
        if not _leftovers():
            break
        time.sleep(0.1)
    assert _leftovers() == []


def test_a_detached_process_holding_the_output_does_not_block_the_call():
    """`isolation: none` (no PID namespace): a double-forked daemon in a new session keeps the
    output pipes open after the code ends; the call returns at once, the daemon killed (with a
    cgroup) or left, said on stderr (without)."""
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.fork() or os.execvp('sleep', ['sleep', '{MARK}'])\n"
        "    os._exit(0)\n"
        "print('done')"
    )
    start = time.monotonic()
    try:
        rc, out, err = run_python(code, timeout_s=5, isolation="none")
        assert time.monotonic() - start < 4
        assert (rc, out) == (0, "done\n"), err
        assert ("left the sandbox" in err) == bool(_leftovers()), err
    finally:
        for pid in _leftovers():  # not a cgroup's: `none` does not bound what escapes it
            os.kill(pid, 9)


@needs_bwrap
def test_output_flood_is_cut_without_filling_memory():
    start = time.monotonic()
    rc, out, _ = run_python("import sys\nfor _ in range(2000): sys.stdout.write('x' * 100000)")
    assert rc == 0 and len(out) == 10_000 and time.monotonic() - start < 5


@needs_bwrap
def test_normal_code_runs():
    rc, out, err = run_python("import math, json; print(json.dumps([math.factorial(5)]))")
    assert (rc, out, err) == (0, "[120]\n", "")
    assert PythonTool({"timeout_s": 3}).execute({"code": "print(6 * 7)"}) == "42\n"


def test_refuses_without_an_isolation_tool(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap.*isolation: none.*own risk"):
        PythonTool()
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run_python("print(1)")


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="unknown python tool config keys.*'timeout'"):
        PythonTool({"timeout": 3})
    with pytest.raises(ValueError, match="memory_mb=0"):
        PythonTool({"memory_mb": 0})
    with pytest.raises(ValueError, match="isolation 'docker'"):
        PythonTool({"isolation": "docker"})
