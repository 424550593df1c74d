"""The Python sandbox tool: code a model wrote runs under bubblewrap (`bwrap`), never in our
own process or with our own file system.

Each call starts `prlimit ... bwrap ... [prlimit --nproc] python -I -c CODE` with
  * new user, mount, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`): no
    network at all, no other process visible, uid 65534 inside;
  * a root file system holding only the system's program directories (`/usr`, `/lib*`, `/bin`)
    and the interpreter's own prefixes (its virtualenv and base installation), all read-only,
    bwrap's own root included: no `/etc`, `/home`, `/root` or run directory exists inside;
  * the only writable places: a private, empty working directory `/work`, `/tmp` and
    `/dev/shm`, each a tmpfs of at most `max_file_mb` (an interpreter prefix under one of them
    is mounted over it, read-only);
  * a seccomp filter refusing SysV shared memory and message queues, and io_uring
    (`sandbox_seccomp`);
  * rlimits on CPU time, address space (per process), file size and open files (`prlimit`,
    util-linux; limits are inherited by every child and cannot be raised inside);
  * `max_processes` and `memory_mb` for the whole run, whoever runs it
    (`hybridjax.tools.sandbox_limits`: a cgroup where one can be made, else RLIMIT_NPROC in the
    sandbox's own user namespace, and a supervisor of the run's process tree);
  * the wall-clock timeout: the outer `bwrap` is killed, which kills the namespace's init and
    with it every process of the sandbox, daemons and new sessions included.

Where `bwrap` is missing the tool refuses to run (`SandboxUnavailable`), unless its config says
`isolation: none` (the code then runs as this user with rlimits only, at the user's own risk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from hybridjax.errors import UserError
from hybridjax.tools.base import Tool, register_tool
from hybridjax.tools.sandbox_limits import (
    RunCgroup,
    Supervisor,
    describe,
    inner_prlimit,
    kernel_counts_tasks,
)
from hybridjax.tools.sandbox_seccomp import ipc_filter

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "none")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
_WORKDIR = "/work"
_PRIVATE_DIRS = (_WORKDIR, "/tmp", "/dev/shm")  # the only writable places, each a sized tmpfs
_NOBODY = "65534"
_DRAIN_S = 1.0  # how long the output is read after the code's process ended


class SandboxUnavailable(UserError, ValueError):
    """No isolation tool on this machine (names the package and the config key)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits of one sandboxed run: wall-clock `timeout_s` (CPU time is limited to its ceiling),
    `memory_mb` for all its processes together (and of address space for each),
    `max_processes` tasks in all (threads included), `max_file_mb` per file and of each
    private tmpfs (`/work`, `/tmp`, `/dev/shm`), `max_open_files` per process, and
    `max_output` characters kept of each of stdout and stderr."""

    timeout_s: float = 5.0
    memory_mb: int = 256
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output: int = 10_000

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"sandbox {field.name}={getattr(self, field.name)}; must be > 0")

    def prlimit_args(self) -> list[str]:
        cpu = int(-(-self.timeout_s // 1))
        return [
            "prlimit",
            f"--cpu={cpu}",
            f"--as={self.memory_mb << 20}",
            f"--fsize={self.max_file_mb << 20}",
            f"--nofile={self.max_open_files}",
            "--core=0",
            "--",
        ]


def require_isolation(isolation: str) -> None:
    """Raises SandboxUnavailable when `isolation` is `bwrap` and `bwrap` or `prlimit` is not
    on PATH, ValueError for an unknown `isolation`."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")
    needed = ("bwrap", "prlimit") if isolation == "bwrap" else ("prlimit",)
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if missing:
        raise SandboxUnavailable(
            f"the Python sandbox needs {' and '.join(missing)} (Debian/Ubuntu packages "
            "bubblewrap and util-linux: apt-get install bubblewrap); or set `isolation: none` "
            "in the python tool's config of the tool config file to run model-written code "
            "unisolated, at your own risk"
        )


def _prefixes() -> list[str]:
    """The interpreter's prefixes (as named and resolved) outside the system directories."""
    named = {sys.prefix, sys.base_prefix}
    return sorted(
        p for p in named | set(map(os.path.realpath, named)) if not _under(p, _SYSTEM_DIRS)
    )


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


@functools.cache
def _bwrap_disables_userns() -> bool:
    """Whether this bwrap has `--disable-userns` (bubblewrap 0.8 and later); warns once if not:
    the code could then make a user namespace and mount a tmpfs no size bounds."""
    usage = subprocess.run(["bwrap", "--help"], capture_output=True, text=True).stdout
    if "--disable-userns" in usage:
        return True
    log.warning(
        "python tool: this bwrap lacks --disable-userns (bubblewrap < 0.8): sandboxed code "
        "can mount file systems of its own, which max_file_mb does not bound"
    )
    return False


def bwrap_args(limits: Limits) -> list[str]:
    """The bubblewrap command line up to the sandboxed program (see the module docstring)."""
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    if _bwrap_disables_userns():  # no user namespace inside, so no mount of a tmpfs of its own
        args += ["--unshare-user", "--disable-userns"]
    args += ["--uid", _NOBODY, "--gid", _NOBODY, "--cap-drop", "ALL"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    prefixes = _prefixes()
    for prefix in prefixes:
        if not _under(prefix, _PRIVATE_DIRS):
            args += ["--ro-bind", prefix, prefix]
    # everything so far, bwrap's own root file system included, becomes read-only; then the
    # private dirs are mounted writable, each a tmpfs of at most max_file_mb
    args += ["--dir", _WORKDIR, "--dir", "/tmp", "--remount-ro", "/", "--remount-ro", "/dev"]
    for path in _PRIVATE_DIRS:
        args += ["--size", str(limits.max_file_mb << 20), "--tmpfs", path]
    for prefix in prefixes:  # an interpreter under a private dir stays visible over it
        if _under(prefix, _PRIVATE_DIRS):
            args += ["--ro-bind", prefix, prefix]
    args += ["--chdir", _WORKDIR]
    env = {"PATH": "/usr/bin:/bin", "HOME": _WORKDIR, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output: int = 10_000,
    isolation: str = "bwrap",
    limits: Limits | None = None,
) -> tuple[int, str, str]:
    """Runs `code` in the sandbox. Returns (exit code, the first `max_output` characters of
    stdout, the last `max_output` of stderr); a process killed by a signal has exit code
    -signal, and a run stopped for its processes or memory ends stderr with a line
    `sandbox: ...` saying which. `limits` (when given) replaces `timeout_s`, `memory_mb` and
    `max_output`.

    Raises:
      TimeoutError: still running after `timeout_s` (every process of the sandbox is killed).
      SandboxUnavailable: `isolation=bwrap` and bubblewrap is not installed.
    """
    limits = limits or Limits(timeout_s, memory_mb, max_output=max_output)
    require_isolation(isolation)
    python = [sys.executable, "-I", "-c", code]
    with contextlib.ExitStack() as stack:
        cgroup = RunCgroup.create(limits.max_processes, limits.memory_mb)
        if cgroup is not None:
            stack.callback(cgroup.close)
        fds: tuple[int, ...] = ()
        if isolation == "bwrap":
            inner = [] if cgroup else inner_prlimit(limits.max_processes)
            seccomp, fds = _seccomp(stack)
            command = limits.prlimit_args() + bwrap_args(limits) + seccomp + inner + python
            cwd = None
        else:
            cwd = stack.enter_context(tempfile.TemporaryDirectory())
            command = limits.prlimit_args() + python
        return _run(_joining(cgroup) + command, limits, cwd, cgroup, isolation, fds)


def _seccomp(stack: contextlib.ExitStack) -> tuple[list[str], tuple[int, ...]]:
    """bwrap's `--seccomp FD` arguments and the fd to pass (a pipe holding the program of
    `sandbox_seccomp.ipc_filter`, closed with `stack`); none on an architecture without one."""
    program = ipc_filter()
    if program is None:
        return [], ()
    read, write = os.pipe()
    os.write(write, program)  # 72 bytes: the pipe holds them
    os.close(write)
    stack.callback(os.close, read)
    return ["--seccomp", str(read)], (read,)


def _joining(cgroup: RunCgroup | None) -> list[str]:
    """A prefix under which the command's first process joins `cgroup`, before it starts any
    other: `sh` writes its own pid to each `cgroup.procs`, then execs the command."""
    if cgroup is None:
        return []
    writes = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in cgroup.procs_files)
    return ["sh", "-c", f'{writes} && exec "$@"', "sh"]


def _run(
    command: list[str],
    limits: Limits,
    cwd: str | None,
    cgroup: RunCgroup | None,
    isolation: str,
    fds: tuple[int, ...] = (),
) -> tuple[int, str, str]:
    env = {"PATH": os.environ.get("PATH", "")}
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out, err = _Reader(proc.stdout, limits.max_output), _Reader(proc.stderr, limits.max_output)
    # what the kernel does not bound, the supervisor does: without a cgroup, the processes and
    # their memory; always, the files of the private tmpfs (a cgroup v1 may not count them)
    supervisor = Supervisor(
        proc.pid,
        max_processes=None if kernel_counts_tasks(cgroup, isolation) else limits.max_processes,
        memory_mb=limits.memory_mb,
        overhead=2 if isolation == "bwrap" else 0,  # bwrap and the namespace's init
        tmpfs=_PRIVATE_DIRS if isolation == "bwrap" else (),
        tmpfs_mb=limits.max_file_mb,
        count_processes=cgroup is None,
    )
    try:
        rc = proc.wait(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired as e:
        _kill_group(proc.pid)
        proc.wait()
        raise TimeoutError(f"code ran longer than {limits.timeout_s} s") from e
    finally:
        supervisor.stop()
        _kill_group(proc.pid)  # children that left the sandbox's init (none can) or `none`
        if cgroup is not None:
            cgroup.kill()  # and those that left the group (`none`: a new session)
        out.join(_DRAIN_S)  # a process that left both (`none`, no cgroup) may hold the
        err.join(_DRAIN_S)  # pipes open for ever: what it writes later is not waited for
    said = f"sandbox: stopped: {supervisor.reason}" if supervisor.reason else ""
    if out.is_alive() or err.is_alive():
        said = "sandbox: a process that left the sandbox holds its output; not waited for"
    if cgroup is not None and cgroup.out_of_memory():
        said = "sandbox: a process was killed: the processes together reached "
        said += f"memory_mb={limits.memory_mb}"
    stderr = err.text(head=False)
    if said:
        stderr = (stderr + f"\n{said}\n")[-limits.max_output :]
    return rc, out.text(head=True), stderr


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Reader(threading.Thread):
    """Drains a pipe, keeping at most `limit` characters (output beyond is read and dropped,
    so a program printing gigabytes neither blocks nor fills memory)."""

    def __init__(self, stream, limit: int):
        super().__init__(daemon=True)
        self.stream, self.limit, self.head, self.tail = stream, limit, b"", b""
        self.start()

    def run(self) -> None:
        while chunk := self.stream.read1(1 << 16):
            if len(self.head) < 4 * self.limit:
                self.head += chunk
            self.tail = (self.tail + chunk)[-4 * self.limit :]
        self.stream.close()

    def text(self, head: bool) -> str:
        data = self.head if head else self.tail
        text = data.decode("utf-8", "replace")
        return text[: self.limit] if head else text[-self.limit :]


def limits_of(config: dict[str, Any]) -> Limits:
    """`Limits` from a tool's `config` mapping (keys as the `Limits` fields); ValueError
    naming an unknown key."""
    fields = {f.name: f.type for f in dataclasses.fields(Limits)}
    unknown = set(config) - set(fields) - {"isolation"}
    if unknown:
        raise ValueError(f"unknown python tool config keys {sorted(unknown)}; known: "
                         f"{sorted(fields) + ['isolation']}")  # fmt: skip
    cast = {"timeout_s": float}
    return Limits(**{k: cast.get(k, int)(v) for k, v in config.items() if k in fields})  # type: ignore[arg-type]


@register_tool("python")
class PythonTool(Tool):
    """`python(code)`: runs the code in the sandbox (`run_python`); returns what it printed.

    Config (tool config file): `isolation` (`bwrap`, default; `none` runs unisolated at the
    user's own risk, its processes and memory bounded by a cgroup or the supervisor only) and
    the `Limits` fields (`timeout_s` 5, `memory_mb` 256, `max_processes`
    64, `max_file_mb` 16, `max_open_files` 64, `max_output` 10000).

    Raises (at construction): SandboxUnavailable without bubblewrap; ValueError for a bad key.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source"}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        self.isolation = str(self.config.get("isolation", "bwrap"))
        self.limits = limits_of(self.config)
        require_isolation(self.isolation)
        bounds = describe(self.limits.max_processes, self.limits.memory_mb, self.isolation)
        log.info("python tool: processes bounded by %(processes)s, memory by %(memory)s", bounds)

    def execute(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("argument 'code' (a string) is required")
        rc, out, err = run_python(code, isolation=self.isolation, limits=self.limits)
        if rc != 0:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            raise RuntimeError(f"exit code {rc}: {last}")
        return out
