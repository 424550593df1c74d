"""A Python sandbox tool: the code runs in a fresh interpreter (`python -I`, its own empty
working directory) under a CPU-time limit, an address-space limit and a wall-clock timeout;
networking is cut by a new network namespace where the kernel allows unprivileged ones, and in
any case by a `socket` module whose sockets cannot be created. The tool returns stdout (and
stderr on failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

from hybridjax.tools.base import Tool, register_tool

# Prepended to the user's code, so the limits are set by the child itself (no `preexec_fn`:
# running Python between fork and exec in a multithreaded process such as JAX's can deadlock):
# CPU time and address space, an empty network namespace where unprivileged user namespaces
# exist, and in any case no sockets.
_PRELUDE = """\
import ctypes as _c, resource as _r, socket as _s
_r.setrlimit(_r.RLIMIT_CPU, ({cpu}, {cpu}))
_r.setrlimit(_r.RLIMIT_AS, ({memory}, {memory}))
try:
    _c.CDLL(None).unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
except (OSError, AttributeError):
    pass
def _refuse(*a, **k):
    raise OSError("network access is disabled in this sandbox")
_s.socket = _s.create_connection = _s.socketpair = _refuse
del _c, _r, _s, _refuse
"""


def run_python(
    code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 10_000
) -> tuple[int, str, str]:
    """Runs `code` in a sandboxed interpreter. Returns (exit code, stdout, stderr), each stream
    cut to `max_output` characters. Raises TimeoutError after `timeout_s` seconds (the process
    is killed). CPU time is limited to ceil(timeout_s) seconds, memory to `memory_mb`."""
    prelude = _PRELUDE.format(cpu=int(-(-timeout_s // 1)), memory=memory_mb << 20)
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", prelude + code],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={"PATH": os.environ.get("PATH", "")},
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
