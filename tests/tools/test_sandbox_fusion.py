"""verl's remote sandbox backend against a SandboxFusion stand-in (FastAPI on localhost,
answering as SandboxFusion's `POST /run_code` does)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from hybridjax.tools import ToolCall, ToolExecutor, load_tools
from hybridjax.tools.sandbox_fusion import VERL_CLASS, SandboxFusionTool
from tests.http_testing import serve

REQUESTS: list[dict] = []


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/run_code")
    async def run_code(request: Request):
        body = await request.json()
        REQUESTS.append(body)
        code = body["code"]
        if code == "crash":
            return PlainTextResponse("upstream exploded", status_code=502)
        if code == "garbage":
            return PlainTextResponse("<html>not json</html>")
        if code == "slow":
            return {"status": "Failed", "run_result": {"status": "TimeLimitExceeded"}}
        if code.startswith("raise"):
            run = {"status": "Finished", "return_code": 1, "stdout": "", "stderr": "x\nValueError"}
            return {"status": "Failed", "message": "", "run_result": run}
        run = {"status": "Finished", "return_code": 0, "stdout": f"ran {code}\n", "stderr": ""}
        return {"status": "Success", "message": "", "run_result": run}

    return app


@pytest.fixture(scope="module")
def url():
    for base in serve(_app()):
        yield base + "/run_code"


def test_runs_code_remotely_with_verls_request(url):
    tool = SandboxFusionTool(
        {"sandbox_fusion_url": url, "default_timeout": 7, "memory_limit_mb": 64}
    )
    assert tool.name == "code_interpreter"
    assert tool.execute({"code": "print(1)"}) == "ran print(1)\n"
    assert REQUESTS[-1] == {
        "code": "print(1)",
        "language": "python",
        "run_timeout": 7.0,
        "memory_limit_MB": 64,
    }


@pytest.mark.parametrize(
    "code, message",
    [
        ("crash", "answered 502: 'upstream exploded'"),
        ("garbage", "answered 200: '<html>not json</html>'"),
        ("slow", "longer than the sandbox's limit"),
        ("raise ValueError", "exit code 1: ValueError"),
    ],
)
def test_failures_name_the_url_status_and_body(url, code, message):
    tool = SandboxFusionTool({"sandbox_fusion_url": url})
    with pytest.raises(RuntimeError, match=message):
        tool.execute({"code": code})


def test_unreachable_service_is_a_tool_error_not_a_crash():
    tool = SandboxFusionTool({"sandbox_fusion_url": "http://127.0.0.1:9/run_code"})
    ex = ToolExecutor([tool], timeout_s=20)
    (result,) = ex.run([ToolCall("code_interpreter", {"code": "print(1)"})])
    assert result.error and "127.0.0.1:9" in result.text and "ConnectError" in result.text
    ex.close()


def test_verls_tool_config_entry_loads(tmp_path, url):
    path = tmp_path / "tools.yaml"
    path.write_text(
        f"tools:\n  - class_name: {VERL_CLASS}\n    config:\n      sandbox_fusion_url: {url}\n"
        "      num_workers: 4\n      rate_limit: 4\n      default_timeout: 30\n      type: native\n"
    )
    (tool,) = load_tools(path)
    assert isinstance(tool, SandboxFusionTool) and tool.execute({"code": "1"}) == "ran 1\n"
    path.write_text("tools:\n  - class_name: sandbox_fusion\n    config: {sandbox_fusion_url: x}\n")
    with pytest.raises(ValueError, match=r"tools\[0\]: sandbox_fusion_url 'x'"):
        load_tools(path)
