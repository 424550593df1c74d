"""A Python sandbox tool: the code runs in a fresh interpreter (`python -I`, its own empty
working directory) under a CPU-time limit, an address-space limit and a wall-clock timeout;
networking is cut by a new network namespace where the kernel allows unprivileged ones, and in
any case by a `socket` module whose sockets cannot be created. The tool returns stdout (and
stderr on failure)."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import tempfile
from typing import Any

from hybridjax.tools.base import Tool, register_tool

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000

# Prepended to the user's code: no sockets at all, whatever the namespace.
_NO_NETWORK = """\
import socket as _s
def _refuse(*a, **k):
    raise OSError("network access is disabled in this sandbox")
_s.socket = _s.create_connection = _s.socketpair = _refuse
del _s, _refuse
"""


def _limit(cpu_s: int, memory_bytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        try:  # best effort: an empty network namespace (needs unprivileged user namespaces)
            ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        except (OSError, AttributeError):
            pass

    return apply


def run_python(
    code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 10_000
) -> tuple[int, str, str]:
    """Runs `code` in a sandboxed interpreter. Returns (exit code, stdout, stderr), each stream
    cut to `max_output` characters. Raises TimeoutError after `timeout_s` seconds (the process
    is killed). CPU time is limited to ceil(timeout_s) seconds, memory to `memory_mb`."""
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", _NO_NETWORK + code],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={"PATH": os.environ.get("PATH", "")},
                preexec_fn=_limit(int(-(-timeout_s // 1)), memory_mb << 20),
            )
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"code ran longer than {timeout_s} s") from e
    return proc.returncode, proc.stdout[:max_output], proc.stderr[-max_output:]


@register_tool("python")
class PythonTool(Tool):
    """`python(code)`: runs the code in the sandbox (`run_python`); returns what it printed.
    Config: `timeout_s` (default 5), `memory_mb` (default 256)."""

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

    def execute(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("argument 'code' (a string) is required")
        rc, out, err = run_python(
            code,
            float(self.config.get("timeout_s", 5.0)),
            int(self.config.get("memory_mb", 256)),
        )
        if rc != 0:
            raise RuntimeError(f"exit code {rc}: {err.strip().splitlines()[-1] if err else ''}")
        return out
