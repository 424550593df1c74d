"""verl's remote code sandbox: a SandboxFusion-compatible HTTP service runs the code.

Tool config file entry (verl's keys; verl's class path is accepted as well):

  - class_name: sandbox_fusion      # or verl.tools.sandbox_fusion_tools.SandboxFusionTool
    config:
      sandbox_fusion_url: http://localhost:8080/run_code
      default_timeout: 30           # seconds the service lets the code run (`run_timeout`)
      default_language: python
      memory_limit_mb: 1024         # `memory_limit_MB`

A call posts `{"code", "language", "run_timeout", "memory_limit_MB"}` to the URL and reads
SandboxFusion's answer `{"status", "message", "run_result": {"status", "return_code", "stdout",
"stderr"}}`. The model reads stdout; a failed run, a non-200 answer or a malformed body raise
with the URL, the HTTP status and the start of the body (the executor turns that into the
tool message). Isolation is the service's: nothing runs on this machine.
"""

from __future__ import annotations

from typing import Any

import httpx

from hybridjax.tools.base import Tool, register_tool

VERL_CLASS = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
_KEYS = {
    "sandbox_fusion_url",
    "default_timeout",
    "default_language",
    "memory_limit_mb",
    # verl's concurrency knobs; here the executor's workers (`multi_turn.tool_workers`) bound
    # the calls in flight, so these are accepted and have no further effect
    "num_workers",
    "rate_limit",
    "enable_global_rate_limit",
    "type",
}
_BODY_SHOWN = 300  # characters of an unexpected body quoted in the error


@register_tool("sandbox_fusion")
class SandboxFusionTool(Tool):
    """`code_interpreter(code)`: runs the code on a SandboxFusion service; returns stdout.

    Raises (at construction): ValueError for a missing or non-http(s) `sandbox_fusion_url`
    or an unknown config key.
    """

    default_schema = {
        "type": "function",
        "function": {
            "name": "code_interpreter",
            "description": "A tool for executing code.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The code to execute."}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        unknown = set(self.config) - _KEYS
        if unknown:
            raise ValueError(f"unknown sandbox_fusion config keys {sorted(unknown)}; "
                             f"known: {sorted(_KEYS)}")  # fmt: skip
        self.url = str(self.config.get("sandbox_fusion_url", ""))
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"sandbox_fusion_url {self.url!r}: set it to the service's run_code URL "
                "(http://host:8080/run_code)"
            )
        self.timeout_s = float(self.config.get("default_timeout", 30))
        self.language = str(self.config.get("default_language", "python"))
        self.memory_mb = int(self.config.get("memory_limit_mb", 1024))

    def execute(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError("argument 'code' (a string) is required")
        request = {
            "code": code,
            "language": str(arguments.get("language", self.language)),
            "run_timeout": self.timeout_s,
            "memory_limit_MB": self.memory_mb,
        }
        try:  # the service's own limit plus a margin for the round trip
            response = httpx.post(self.url, json=request, timeout=self.timeout_s + 10)
        except httpx.HTTPError as e:
            raise RuntimeError(f"sandbox {self.url}: {type(e).__name__}: {e}") from e
        return run_output(self.url, response.status_code, response.text, _json(response))


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def run_output(url: str, status: int, body: str, answer: Any) -> str:
    """stdout of a SandboxFusion answer; RuntimeError naming `url`, `status` and the body's
    start for anything but a finished run with return code 0."""
    shown = body[:_BODY_SHOWN]
    run = answer.get("run_result") if isinstance(answer, dict) else None
    if status != 200 or not isinstance(run, dict):
        raise RuntimeError(f"sandbox {url} answered {status}: {shown!r}")
    if run.get("status") == "TimeLimitExceeded":
        raise RuntimeError(f"code ran longer than the sandbox's limit ({url})")
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    if answer.get("status") != "Success" or run.get("return_code") != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else answer.get("message", "")
        raise RuntimeError(f"exit code {run.get('return_code')}: {last}")
    return stdout
