"""CI's machinery: the README's test command as `.ci/run` splits it into phases, and the slow
suite's recycled workers (`tests/worker_recycling.py`) on a small suite of their own run in a
subprocess: a worker killed by SIGSEGV fails its one test, named with the signal, and the run
goes on; with `--recycle-workers-after=0` every file gets a process of its own."""

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CONFTEST = """
from tests.worker_recycling import (  # noqa: F401
    pytest_addoption, pytest_configure, pytest_handlecrashitem, pytest_testnodedown,
    pytest_xdist_make_scheduler,
)
"""

_RECORD = """
import os
import time
from pathlib import Path


def _zombies():
    # the controller's children that exited and were not waited for
    found = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found += fields[0] == "Z" and int(fields[1]) == os.getppid()
    return found


def _record(name):
    # when this test ran, on which process: a short test, so overlapping runs show
    start = time.monotonic()
    time.sleep(0.3)
    Path(name + "." + str(os.getpid())).write_text(f"{start} {time.monotonic()} {_zombies()}")
"""


_CRASHING = """
import signal


def test_before():
    _record("crashing_before")


def test_killed():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_after():
    _record("crashing_after")
"""


def _suite(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_crashing.py").write_text(_RECORD + textwrap.dedent(_CRASHING))
    for name in ("b", "c", "d"):
        body = f"\n\ndef test_{name}():\n    _record({name!r})\n"
        (tmp_path / f"test_{name}.py").write_text(_RECORD + body)


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    return subprocess.run(
        [*command, "--dist", "loadfile", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _pids(tmp_path: Path, name: str) -> set[str]:
    return {path.suffix for path in tmp_path.glob(name + ".*")}


def test_a_killed_worker_fails_its_test_alone_and_files_get_fresh_workers(tmp_path):
    _suite(tmp_path)
    run = _pytest(tmp_path, "--recycle-workers-after=0", "--max-worker-restart=1")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "crashed while running 'test_crashing.py::test_killed' (killed by SIGSEGV)" in out, out
    assert "1 failed, 5 passed" in out, out  # not rerun; the file's last test ran elsewhere
    pids = [_pids(tmp_path, name) for name in ("crashing_before", "crashing_after", "b", "c", "d")]
    assert all(len(p) == 1 for p in pids), pids
    # each file on a process of its own: the crash put test_after on a fresh worker too
    assert len(set.union(*pids)) == 5, pids
    # recycling starts a fresh worker only for a retired one: never more than two tests at once
    records = [path.read_text().split() for path in tmp_path.glob("*.[0-9]*")]
    spans = [(float(start), float(end)) for start, end, _ in records]
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2, spans
    # retired workers are waited for as they exit: none stays a zombie of the controller (4
    # retire here; without the wait, the later tests see one)
    assert all(zombies == "0" for *_, zombies in records), records


def test_recycling_needs_loadfile(tmp_path):
    _suite(tmp_path)
    run = _pytest(tmp_path, "--recycle-workers-after=0", "--dist", "load")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--recycle-workers-after needs -n N --dist loadfile" in run.stderr


def _test_command(markdown: Path) -> str:
    text = markdown.read_text()
    return text.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]


def test_ci_runs_the_readmes_command_phase_by_phase():
    phases = subprocess.run(
        [REPO / ".ci" / "run", "--phases"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    names = [line.split("\t")[0] for line in phases]
    assert names == ["install", "fast", "slow", "gpu-aot"], phases
    fast, slow, gpu_aot = (line.split("\t")[1] for line in phases[1:])
    assert '-m "not slow"' in fast and "--durations=25" in fast, fast
    assert "-m slow" in slow and "--recycle-workers-after=" in slow, slow
    assert gpu_aot == "experiments/gpu/aot_tests.sh", gpu_aot
    # the docs show the same command, and it is one shell command a user can paste
    readme = _test_command(REPO / "README.md")
    assert readme == _test_command(REPO / "docs" / "getting-started.md")
    subprocess.run(["bash", "-n", "-c", readme.split("```bash")[1].split("```")[0]], check=True)


class _Node:
    """The part of xdist's WorkerController the scheduler uses."""

    def __init__(self, name: str) -> None:
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_worker_still_collecting_is_given_work_only_once_it_has_collected():
    """Two workers replaced at once: the first to finish collecting triggers `schedule()`
    while the other has not collected yet (that once crashed the controller)."""
    from tests.worker_recycling import pytest_xdist_make_scheduler

    options = {"recycle_workers_after": 300.0, "tx": ["2*popen"]}
    config = types.SimpleNamespace(
        getoption=lambda name, default=None: options.get(name, default),
        getvalue=lambda name: options[name],
        option=types.SimpleNamespace(loadscopereorder=False),
    )
    sched = pytest_xdist_make_scheduler(config, None)
    collection = [f"test_{name}.py::test_{i}" for name in "abcde" for i in (1, 2)]
    first, second, late = _Node("gw0"), _Node("gw1"), _Node("gw2")
    for node in (first, second):
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert first.sent == [[0, 1]] and second.sent == [[2, 3]]  # one file each, not two
    sched.add_node(late)
    sched.schedule()  # as another new worker's collection would
    assert late.sent == []
    sched.add_node_collection(late, collection)
    sched.schedule()
    assert late.sent == [[4, 5]]


def test_a_child_process_compiles_as_the_suite_does_on_its_own_devices(monkeypatch):
    from tests.child_env import child_env

    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
    )
    env = child_env(devices=2, PYTHONPATH="/x")
    assert env["XLA_FLAGS"].split() == [
        "--xla_backend_optimization_level=0",
        "--xla_force_host_platform_device_count=2",
    ]
    assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONPATH"] == "/x"
    assert child_env()["XLA_FLAGS"] == "--xla_backend_optimization_level=0"  # one device
    assert "XLA_FLAGS" not in child_env(as_user=True)  # a user's run: full optimisation
    assert os.environ["XLA_FLAGS"].endswith("count=8")  # this process's are left as they were
