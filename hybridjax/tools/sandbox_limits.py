"""Limits on a whole sandbox run, not on each of its processes or on the user running it.

Processes (`max_processes`, threads included) and memory (`memory_mb`, every process of the
run together) are bounded by the first mechanism this machine and user allow:

  * a cgroup per run (`RunCgroup`): cgroup v2 `pids.max` and `memory.max` (swap off) where a
    cgroup v2 hierarchy with those controllers is writable (root on a cgroup v2 host), else the
    cgroup v1 `pids` and `memory` hierarchies (`pids.max`, `memory.limit_in_bytes`) where
    writable. The kernel then refuses a fork past the limit (`BlockingIOError`) and OOM-kills
    inside the run only;
  * processes, without a cgroup: `RLIMIT_NPROC` set inside the sandbox's own user namespace
    (`inner_prlimit`). The kernel counts it per user per user namespace, so it counts this
    run's tasks and nothing of the trainer's; it does not apply to the real root user, whose
    sandbox has a cgroup or the supervisor;
  * always, as the backstop: the supervisor (`Supervisor`), a thread that walks the run's
    process tree every `POLL_S` seconds and kills the whole run when its tasks exceed
    `max_processes` or their memory (proportional set sizes, so pages shared after a fork
    count once) exceeds `memory_mb`. Memory no process maps counts too: memory files
    (`memfd_create`) held open, each counted once, and what the sandbox's private tmpfs hold
    (their bytes, and `INODE_BYTES` of kernel memory per file: a million empty files cost a
    gigabyte that no page count shows). With a cgroup the supervisor still counts the tmpfs
    files, which a cgroup v1 without kernel-memory accounting does not. It may overshoot by
    what a run allocates in one poll; each process also keeps `RLIMIT_AS` of `memory_mb`.
    Not counted without a cgroup: pipe and socket buffers (bounded by `max_open_files` per
    process); SysV shared memory and message queues cannot be made (`sandbox_seccomp`).

`mechanisms(run_cgroup, isolation)` names what bounds a run; the python tool logs it (at INFO)
when it is built.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time

from hybridjax.process_tree import descendants

POLL_S = 0.02
INODE_BYTES = 2048  # kernel memory charged per tmpfs file (inode and dentry: 1.2-2.6 kB measured)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_COUNTER = itertools.count()


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of each cgroup mount."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[4], fstype, options))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under '' its cgroup v2 path."""
    paths = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class RunCgroup:
    """The cgroup(s) of one sandbox run. `create` returns None where none can be made (not
    root, no delegation); otherwise the run's first process writes its pid to each of
    `procs_files` before it starts the sandbox. `close()` kills what is left and removes them."""

    def __init__(self, dirs: list[str], version: str):
        self.dirs, self.version = dirs, version
        self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

    @classmethod
    def create(cls, max_processes: int, memory_mb: int) -> RunCgroup | None:
        name = f"hybridjax-sandbox-{os.getpid()}-{next(_COUNTER)}"
        mounts, own = _mounts(), _own_cgroups()
        for mount, fstype, _ in mounts:
            if fstype == "cgroup2":
                with contextlib.suppress(OSError):
                    return cls._v2(mount, name, max_processes, memory_mb)
        v1 = {c: m for m, fstype, opts in mounts if fstype == "cgroup" for c in ("pids", "memory")
              if c in opts}  # fmt: skip
        if set(v1) != {"pids", "memory"}:
            return None
        made: dict[str, str] = {}
        try:
            for controller, mount in v1.items():
                path = os.path.join(mount, own.get(controller, "/").lstrip("/"), name)
                os.mkdir(path)
                made[controller] = path
            _write(os.path.join(made["pids"], "pids.max"), str(max_processes))
            memory = os.path.join(made["memory"], "memory.")
            _write(memory + "limit_in_bytes", str(memory_mb << 20))
            with contextlib.suppress(OSError):  # memory + swap, where swap accounting is on
                _write(memory + "memsw.limit_in_bytes", str(memory_mb << 20))
        except OSError:
            for path in made.values():
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            return None
        return cls(list(made.values()), "cgroup v1")

    @classmethod
    def _v2(cls, mount: str, name: str, max_processes: int, memory_mb: int) -> RunCgroup:
        """Under `<mount>/hybridjax-sandbox`, a directory of run cgroups with no process of its
        own (so it may delegate controllers). Raises OSError where not allowed."""
        with open(os.path.join(mount, "cgroup.controllers")) as f:
            if not {"pids", "memory"} <= set(f.read().split()):
                raise OSError("cgroup v2 without the pids and memory controllers")
        parent = os.path.join(mount, "hybridjax-sandbox")
        os.makedirs(parent, exist_ok=True)
        _write(os.path.join(parent, "cgroup.subtree_control"), "+pids +memory")
        path = os.path.join(parent, name)
        os.mkdir(path)
        try:
            _write(os.path.join(path, "pids.max"), str(max_processes))
            _write(os.path.join(path, "memory.max"), str(memory_mb << 20))
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "memory.swap.max"), "0")
        except OSError:
            os.rmdir(path)
            raise
        return cls([path], "cgroup v2")

    def out_of_memory(self) -> bool:
        """Whether the kernel OOM-killed a process of this run."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError), open(os.path.join(d, name)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
                    if int(counts.get("oom_kill", 0)) > 0:
                        return True
        return False

    def kill(self) -> None:
        """Sends SIGKILL to every process now in the run's cgroups."""
        for d in self.dirs:
            with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        """Kills every process left in the run's cgroups and removes them."""
        for d in self.dirs:
            for _ in range(50):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
                    break
                self.kill()
                time.sleep(0.01)


def mechanisms(run_cgroup: RunCgroup | None, isolation: str) -> dict[str, str]:
    """What bounds a run's processes and its memory, e.g. `{"processes": "cgroup v1 pids.max",
    "memory": "cgroup v1 memory.limit_in_bytes"}`; the supervisor backs up every entry."""
    if run_cgroup is not None:
        v2 = run_cgroup.version == "cgroup v2"
        memory = "memory.max" if v2 else "memory.limit_in_bytes"
        return {"processes": f"{run_cgroup.version} pids.max",
                "memory": f"{run_cgroup.version} {memory}"}  # fmt: skip
    supervisor = f"supervisor (process tree every {POLL_S} s)"
    processes = supervisor
    if kernel_counts_tasks(None, isolation):
        processes = "RLIMIT_NPROC in the sandbox's user namespace"
    return {"processes": processes,
            "memory": f"{supervisor}: resident memory, memory files and tmpfs"}  # fmt: skip


def kernel_counts_tasks(run_cgroup: RunCgroup | None, isolation: str) -> bool:
    """Whether the kernel bounds a run's tasks: by its cgroup, or by RLIMIT_NPROC in bwrap's
    user namespace (which the kernel does not apply to the real root user)."""
    return run_cgroup is not None or (isolation == "bwrap" and os.geteuid() != 0)


def describe(max_processes: int, memory_mb: int, isolation: str) -> dict[str, str]:
    """`mechanisms` of a run on this machine as this user (makes and removes a trial cgroup)."""
    cgroup = RunCgroup.create(max_processes, memory_mb)
    if cgroup is not None:
        cgroup.close()
    return mechanisms(cgroup, isolation)


def inner_prlimit(max_processes: int) -> list[str]:
    """The command prefix, run inside the sandbox's user namespace, that bounds its tasks."""
    return ["prlimit", f"--nproc={max_processes}", "--"]


def _usage(
    pids: list[int], count_processes: bool = True, tmpfs: tuple[str, ...] = (), tmpfs_mb: int = 0
) -> tuple[int, int]:
    """(tasks, bytes) of `pids`: their threads, and (`count_processes`) their proportional
    set size (shared pages split between their sharers, so forked children are not counted
    twice; resident size where /proc/<pid>/smaps_rollup is missing) plus the memory files they
    hold open, and the use of the private tmpfs `tmpfs` (of `tmpfs_mb` each) as their mount
    namespace sees them. A process that has exited counts nothing."""
    tasks = used = 0
    memfds: dict[tuple[int, int], int] = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                tasks += int(f.read().rsplit(")", 1)[1].split()[17])
            if count_processes:
                used += _pss(pid)
                memfds.update(_memfds(pid))
    return tasks, used + sum(memfds.values()) + _tmpfs_use(pids, tmpfs, tmpfs_mb)


def _memfds(pid: int) -> dict[tuple[int, int], int]:
    """{(device, inode): bytes} of the memory files (`memfd_create`) `pid` holds open."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                held[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return held


def _tmpfs_use(pids: list[int], dirs: tuple[str, ...], size_mb: int) -> int:
    """Bytes and `INODE_BYTES` per file of the tmpfs of `size_mb` at `dirs`, seen from the
    first of `pids` in another mount namespace than ours (the sandbox's); a directory not
    (yet) such a tmpfs counts nothing (bwrap mounts them after it enters its namespace)."""
    ours = os.readlink("/proc/self/ns/mnt")
    for pid in pids if dirs else []:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/mnt") == ours:
                continue
            used = 0
            for d in dirs:
                st = os.statvfs(f"/proc/{pid}/root{d}")
                if st.f_blocks * st.f_frsize <= (size_mb << 20) + _PAGE:
                    used += (st.f_blocks - st.f_bfree) * st.f_frsize
                    used += (st.f_files - st.f_ffree) * INODE_BYTES
            return used
    return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class Supervisor(threading.Thread):
    """Polls the process tree under `pid` every `POLL_S` s; when its tasks exceed
    `max_processes` + `overhead` (the sandbox's own launcher processes) or its memory exceeds
    `memory_mb`, kills process group `pid` and says why in `reason`. Memory: the sum of
    proportional set sizes and held memory files (`count_processes`; off where a cgroup
    bounds them) and the use of the sandbox's private tmpfs `tmpfs` of `tmpfs_mb` each (see
    `_usage`). A limit of None is not checked (a kernel mechanism bounds it exactly)."""

    def __init__(
        self,
        pid: int,
        max_processes: int | None,
        memory_mb: int | None,
        overhead: int,
        tmpfs: tuple[str, ...] = (),
        tmpfs_mb: int = 0,
        count_processes: bool = True,
    ):
        super().__init__(daemon=True)
        self.pid, self.overhead, self.tmpfs, self.tmpfs_mb = pid, overhead, tmpfs, tmpfs_mb
        self.max_processes, self.memory_mb = max_processes, memory_mb
        self.count_processes = count_processes
        self.reason = ""
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(POLL_S):
            tree = descendants(self.pid)
            tasks, used = _usage(tree, self.count_processes, self.tmpfs, self.tmpfs_mb)
            if self.max_processes is not None and tasks > self.max_processes + self.overhead:
                self.reason = f"more than max_processes={self.max_processes} processes"
            elif self.memory_mb is not None and used > self.memory_mb << 20:
                self.reason = f"{used >> 20} MiB in use > memory_mb={self.memory_mb}"
            if self.reason:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
                return

    def stop(self) -> None:
        self._done.set()
        self.join()
