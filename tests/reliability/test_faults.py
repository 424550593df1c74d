"""Faults of issue 31's kinds, probe style: each case drives one fault through the public
surface and passes only when the outcome is safe (contained, refused with a message naming
what and where, or counted as a failure), never when it is silently accepted.

Kinds: model-written code escaping the sandbox, a tool blocking the trainer, two runs on one
directory, a reward poisoning the update, bad weights or data accepted at the edge, a
traceback instead of a message. Imports are inside the cases, so the file also runs against
an older checkout (`PYTHONPATH=<checkout> pytest tests/reliability/test_faults.py`) to count
the cases it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "1000.27182"  # argv of processes an escape leaves behind


def _leftovers() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += [int(pid)] if MARK.encode() in f.read() else []
        except OSError:
            continue
    return found


@pytest.fixture
def no_leftovers():
    yield
    for _ in range(30):
        left = _leftovers()
        if not left:
            return
        time.sleep(0.1)
    for pid in left:  # an escaped process: end it, then fail the case
        os.kill(pid, 9)
    pytest.fail(f"processes outlived the sandbox: {left}")


def _run(code: str, **kw):
    from hybridjax.tools.sandbox import run_python

    return run_python(code, **kw)


# ------------------------------------------------------------------------ sandbox escapes


def _beside_the_interpreter(directory: str) -> str:
    """Code printing the first entry of `directory` that does not lead to the interpreter's
    prefixes (its virtualenv, its base installation): the sandbox mounts those and nothing
    else from the host, wherever they live, so the code fails (no entry, or no directory)."""
    named = {sys.prefix, sys.base_prefix}
    prefixes = named | {os.path.realpath(p) for p in named}
    top = directory.rstrip("/") + "/"
    leads = {os.path.relpath(p, directory).split(os.sep)[0] for p in prefixes if p.startswith(top)}
    return (
        f"import os; print([p for p in os.listdir({directory!r}) if p not in {sorted(leads)}][0])"
    )


@pytest.mark.parametrize(
    "code",
    [
        "print(open('/etc/passwd').read())",
        "print(open('/etc/hostname').read())",
        _beside_the_interpreter("/home"),
        f"print(open({os.path.join(REPO, 'pyproject.toml')!r}).read()[:20])",
        _beside_the_interpreter("/root"),
        _beside_the_interpreter(os.path.expanduser("~")),
    ],
    ids=["etc-passwd", "etc-hostname", "home", "the-repository", "root-home", "user-home"],
)
def test_code_cannot_read_host_files(code):
    rc, out, _ = _run(code)
    assert rc != 0 and out == ""


def test_code_cannot_write_or_delete_outside_its_directory(tmp_path):
    victim = tmp_path / "global_step_3"
    victim.mkdir()
    (victim / "state").write_text("weights")
    for code in (
        f"import shutil; shutil.rmtree({str(victim)!r})",
        f"open({str(tmp_path / 'planted')!r}, 'w').write('x')",
        f"import os; os.rename({str(victim)!r}, {str(tmp_path / 'moved')!r})",
    ):
        _run(code)
    assert (victim / "state").read_text() == "weights"
    assert sorted(os.listdir(tmp_path)) == ["global_step_3"]


@pytest.mark.parametrize(
    "spawn",
    [
        # 50: under max_processes=64, which now holds for root too (past it, forks fail)
        f"[subprocess.Popen(['sleep', '{MARK}']) for _ in range(50)]",
        f"subprocess.Popen(['sleep', '{MARK}'], start_new_session=True)",
        f"os.fork() or (os.setsid(), os.fork() or os.execvp('sleep', ['sleep', '{MARK}']))",
        f"subprocess.Popen(['sh', '-c', 'trap \"\" HUP TERM; exec sleep {MARK}'])",
    ],
    ids=["many-children", "new-session", "double-fork", "ignoring-signals"],
)
def test_no_process_outlives_the_timeout(spawn, no_leftovers):
    code = f"import os, subprocess, time\n{spawn}\ntime.sleep(100)"
    with pytest.raises(TimeoutError):
        _run(code, timeout_s=1.5)


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)",
        "import socket, importlib; importlib.reload(socket); "
        "socket.create_connection(('1.1.1.1', 53), timeout=2)",
        "import _socket; s = _socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 53))",
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
        "import urllib.request; urllib.request.urlopen('http://example.com', timeout=2)",
    ],
    ids=["connect", "after-reload", "raw-_socket", "urllib"],
)
def test_code_has_no_network(code):
    rc, _, err = _run(code)
    assert rc != 0 and ("unreachable" in err or "gaierror" in err or "URLError" in err)


def test_code_cannot_see_the_trainers_secrets_or_processes(monkeypatch):
    monkeypatch.setenv("HYBRIDJAX_REWARD_TOKEN", "s3cret")
    rc, out, _ = _run(
        "import os; print(os.environ.get('HYBRIDJAX_REWARD_TOKEN'), "
        "sum(p.isdigit() for p in os.listdir('/proc')) < 5)"
    )
    assert (rc, out) == (0, "None True\n")


@pytest.mark.parametrize(
    "code",
    [
        "open('f', 'wb').write(b'x' * (200 << 20))",
        "import sys\nfor _ in range(3000): sys.stdout.write('y' * 100_000)",
        "x = [open('/dev/null') for _ in range(5000)]",
    ],
    ids=["fill-disk", "flood-output", "open-files"],
)
def test_code_cannot_exhaust_the_host(code, tmp_path):
    start = time.monotonic()
    rc, out, err = _run(code, timeout_s=10)
    assert time.monotonic() - start < 10 and len(out) <= 10_000 and len(err) <= 10_000
    assert rc != 0 or len(out) == 10_000


# ------------------------------------------------------------------------ tools that block


@pytest.mark.parametrize(
    "expression", ["round(10**100, -10**18)", "round(7, 10**9)", "(10**100)**100 % 7"]
)
def test_calculator_refuses_unbounded_work(expression):
    """In a subprocess: an unbounded evaluation would hold this process's GIL for hours."""
    code = (
        "from hybridjax.tools.calculator import evaluate\n"
        f"try:\n    evaluate({expression!r})\nexcept ValueError as e:\n    print('refused', e)"
    )
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO))
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"evaluate({expression!r}) still running after 30 s")
    assert out.stdout.startswith("refused"), out.stderr[-300:]


def test_a_tool_holding_the_gil_cannot_freeze_the_caller():
    """In a subprocess, as above: the call must come back within the executor's deadline."""
    code = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, "tests/tools")
        from tool_fixtures import BigPower
        from hybridjax.tools import ToolCall, ToolExecutor
        ex = ToolExecutor([BigPower()], timeout_s=2.0)
        start = time.monotonic()
        (result,) = ex.run([ToolCall("big_power", {})])
        print(round(time.monotonic() - start), result.error, result.text, flush=True)
        ex.close()
    """)
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO))
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=40
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the executor's call did not come back within 40 s")
    seconds, error, text = out.stdout.split(" ", 2)
    assert int(seconds) < 8 and error == "True" and "timed out" in text, out.stderr[-300:]


# ------------------------------------------------------------------- two runs, one directory


def _hold_in_subprocess(directory) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        from hybridjax.checkpointing.run_lock import hold
        hold({str(directory)!r}, "trainer.default_local_dir")
        print("held", flush=True)
        import time; time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_on_a_held_directory_is_refused_naming_the_holder(tmp_path):
    from hybridjax.checkpointing.run_lock import DirectoryInUseError, hold

    other = _hold_in_subprocess(tmp_path / "run")
    try:
        with pytest.raises(DirectoryInUseError, match=f"pid {other.pid} on host"):
            hold(str(tmp_path / "run"), "trainer.default_local_dir")
    finally:
        other.kill()
        other.wait()


def test_a_killed_runs_lock_is_taken_over(tmp_path):
    from hybridjax.checkpointing.run_lock import hold

    other = _hold_in_subprocess(tmp_path / "run")
    other.kill()
    other.wait()
    hold(str(tmp_path / "run"), "trainer.default_local_dir").release()


# --------------------------------------------------------------------- rewards that poison


@pytest.mark.parametrize(
    "value", [1e300, -1e39, 1e12, float("inf"), "1.0", None, [1.0], {"score": "1"}]
)
def test_a_poisonous_reward_fails_its_row(value):
    from hybridjax.rewards import RewardConfig, RewardManager

    score = lambda source, text, *a: value if text == "bad" else 1.0  # noqa: E731
    manager = RewardManager(RewardConfig(), compute_score=score)
    result = manager(["bad", "ok"], ["s"] * 2, ["t"] * 2, None, np.array([1, 1]), 1)
    manager.close()
    failed = sum(result.metrics[k] for k in ("reward/num_errors", "reward/num_nonfinite"))
    assert failed == 1 and np.isfinite(result.token_level_scores).all()
    assert list(result.scores) == [0.0, 1.0]


def test_most_rows_failing_for_steps_stops_the_run():
    from hybridjax.config.schema import base_config
    from hybridjax.rewards import RewardResult
    from hybridjax.rewards.guard import RewardFailureError, RewardFailureGuard

    guard = RewardFailureGuard.from_config(base_config())
    zeros = RewardResult(np.zeros((4, 1)), np.zeros(4), {}, {"reward/num_errors": 4.0})
    with pytest.raises(RewardFailureError, match="max_consecutive_failed_steps"):
        for step in range(1, 10):
            guard.count(zeros, step)
            assert not guard.may_save()


def _serve(answer):
    """A reward 'server' answering every POST with `answer` = (status, body)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(200, b'{"kind": "rule", "serves": "x"}')

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(*answer)

        def _send(self, status, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


@pytest.mark.parametrize(
    "answer",
    [(200, b"<html>oops</html>"), (200, b'{"results": 3}'), (200, b"{}"), (503, b"overloaded")],
    ids=["html", "results-not-a-list", "no-results", "503"],
)
def test_a_bad_server_answer_fails_rows_naming_url_and_body(answer):
    from hybridjax.rewards import RewardConfig, RewardFunctionError, RewardManager

    server, url = _serve(answer)
    remote = dict(urls=url, max_retries=1, timeout_s=5, retry_backoff_s=0.0)
    manager = RewardManager(RewardConfig.from_config({"reward_model": {"remote": remote}}))
    try:  # every row of the first batch failed: the run stops naming the first failure
        with pytest.raises(RewardFunctionError) as err:
            manager(["a"], ["s"], ["t"], None, np.array([1]), 1)
    finally:
        manager.close()
        server.shutdown()
    assert f"reward server {url}" in str(err.value) and str(answer[0]) in str(err.value)
    assert answer[1].decode()[:8] in str(err.value)


# ------------------------------------------------------------------ weights and data at the edge


def _tiny_checkpoint(tmp_path):
    from flax import nnx

    from hybridjax.models import CausalLM
    from hybridjax.models.config import ModelConfig
    from hybridjax.models.hf_io import save_pretrained

    config = ModelConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_bias=True,
    )  # fmt: skip
    save_pretrained(CausalLM(config, nnx.Rngs(0)), tmp_path)
    return tmp_path / "model.safetensors"


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_non_float_weights_are_refused(tmp_path, dtype):
    from safetensors.numpy import load_file, save_file

    from hybridjax.models.hf_io import load_pretrained

    file = _tiny_checkpoint(tmp_path)
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].astype(dtype)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=f"{name}.*in model.safetensors"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("cut", [16, 0.6])
def test_a_truncated_weights_file_is_named(tmp_path, cut):
    from hybridjax.models.hf_io import load_pretrained

    file = _tiny_checkpoint(tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[: cut if isinstance(cut, int) else int(len(data) * cut)])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_pretrained(tmp_path)


# ---------------------------------------------------------------- messages, not tracebacks


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_read_only_output_directory_is_a_message(tmp_path):
    """`python -m hybridjax.train` on a read-only `trainer.default_local_dir`: one line."""
    run = tmp_path / "run"
    run.mkdir()
    # paths as arguments, not in the line: the interpreter or tmp may have spaces in their path
    cmd = 'mount --bind -o ro "$1" "$1" && exec "$2" -m hybridjax.train "$3"'
    args = [tmp_path, sys.executable, f"--config.trainer.default_local_dir={run}"]
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", REPO), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", cmd, "sh", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if "mount:" in out.stderr:
        pytest.skip(f"no private read-only mount here: {out.stderr.strip()}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot write to {run}" in out.stderr
