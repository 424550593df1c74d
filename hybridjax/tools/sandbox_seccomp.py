"""A seccomp filter for the Python sandbox: no SysV shared memory or message queues, no
io_uring.

A segment no process has attached, or a message queue, holds memory no process map shows, so
without a cgroup nothing counted it: as `nobody`, six 100 MB segments were held under
`memory_mb=256` (issue 48's second probe). Their creation (`shmget`, `msgget`) fails with EPERM;
Python's own shared memory (`multiprocessing.shared_memory`, POSIX semaphores) lives in the
sandbox's `/dev/shm`, a sized tmpfs. io_uring (`io_uring_setup`, `io_uring_enter`,
`io_uring_register`) is refused too (EPERM): its operations run in kernel workers that no
seccomp filter sees, and it has been a leading source of kernel exploits (container runtimes'
default profiles refuse it too); Python does not use it (issue 48's third probe found it
allowed). bwrap loads the filter (`--seccomp FD`); on a machine whose
architecture is not listed here there is no filter (`ipc_filter` returns None).

The program is classic BPF over `struct seccomp_data` (`nr` at offset 0, `arch` at 4): Linux's
`include/uapi/linux/seccomp.h`, `filter.h` and `audit.h`; syscall numbers from the kernel's
tables (x86_64 `syscall_64.tbl`, arm64 `asm-generic/unistd.h`).
"""

from __future__ import annotations

import errno
import platform
import struct

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_DENY = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
_X32 = 0x40000000  # x86_64's x32 calls: every one refused (nothing here uses that ABI)

_IO_URING = (425, 426, 427)  # io_uring_setup, _enter, _register: one number on both tables
# machine: (AUDIT_ARCH_*, refused calls: shmget, msgget, then io_uring's)
_ARCHES = {
    "x86_64": (0xC000003E, (29, 68, *_IO_URING)),
    "aarch64": (0xC00000B7, (194, 186, *_IO_URING)),
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def ipc_filter(machine: str | None = None) -> bytes | None:
    """The filter program for `machine` (default: this one), or None for another
    architecture. Other architectures' calls (a 32-bit binary on x86_64) are refused."""
    arch, refused = _ARCHES.get(machine or platform.machine(), (None, ()))
    if arch is None:
        return None
    n = len(refused)
    program = [
        _insn(_LD_W_ABS, 4),  # arch
        _insn(_JEQ_K, arch, 1, 0),
        _insn(_RET_K, _DENY),
        _insn(_LD_W_ABS, 0),  # nr
        _insn(_JGE_K, _X32, n + 1, 0),  # to the last instruction, DENY
        *(_insn(_JEQ_K, nr, n - i, 0) for i, nr in enumerate(refused)),
        _insn(_RET_K, _ALLOW),
        _insn(_RET_K, _DENY),
    ]
    return b"".join(program)
