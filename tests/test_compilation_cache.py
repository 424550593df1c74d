"""The persistent compilation cache (`hybridjax.compilation_cache`): `trainer.compilation_cache_dir`
sets JAX's cache directory, `""` turns it off, the user's `JAX_COMPILATION_CACHE_DIR` wins, and
`python -m hybridjax.train` applies it before anything compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from hybridjax import compilation_cache as cc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "jax_compilation_cache_dir"


@pytest.fixture
def jax_cache_config(monkeypatch):
    """The environment without the test suite's cache variable; JAX's setting restored after."""
    monkeypatch.delenv(cc.ENV, raising=False)
    before = getattr(jax.config, KEY)
    yield
    jax.config.update(KEY, before)


def test_the_key_sets_jax_cache_directory(jax_cache_config, tmp_path):
    path = str(tmp_path / "cache")
    assert cc.set_compilation_cache(path) == path
    assert getattr(jax.config, KEY) == path


def test_an_empty_key_turns_the_cache_off(jax_cache_config):
    jax.config.update(KEY, None)
    assert cc.set_compilation_cache("") == ""
    assert getattr(jax.config, KEY) is None


def test_the_environment_wins(jax_cache_config, monkeypatch, tmp_path):
    jax.config.update(KEY, None)
    monkeypatch.setenv(cc.ENV, str(tmp_path / "env"))
    assert cc.set_compilation_cache(str(tmp_path / "key")) == str(tmp_path / "env")
    assert cc.set_compilation_cache("") == str(tmp_path / "env")
    assert getattr(jax.config, KEY) is None  # JAX read the variable itself when imported


def test_auto_is_under_the_user_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir("auto", "gpu") == cc.cache_dir("auto", "tpu") == cc.default_cache_dir()
    assert cc.cache_dir("auto", "cpu") == cc.cache_dir("auto") == ""  # this suite runs on CPU
    assert cc.default_cache_dir().startswith(str(tmp_path))
    assert cc.default_cache_dir().endswith(os.path.join("hybridjax", "jax"))
    assert cc.cache_dir("~/here") == os.path.join(str(tmp_path), "here")


DRIVER = """
import contextlib, io, json, sys
import jax
from hybridjax.errors import cli_errors
from hybridjax.train import run
from tests.rl.tiny_run import load_config_file
out = {}
for name, value in json.loads(sys.argv[1]).items():
    jax.config.update("jax_compilation_cache_dir", None)
    cfg = load_config_file("tiny")
    cfg.trainer.default_local_dir = sys.argv[2] + "/" + name
    if value is not None:
        cfg.trainer.compilation_cache_dir = value
    cfg.reward_model.on_error = "ignore"  # a config error: the run stops before any model
    try:
        with contextlib.redirect_stderr(io.StringIO()), cli_errors("hybridjax.train"):
            run(cfg)
    except SystemExit:
        pass
    out[name] = jax.config.jax_compilation_cache_dir
print("RESULTS" + json.dumps(out))
"""


def test_the_train_command_applies_the_key_before_it_builds_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (cc.ENV, "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")  # the default lands here, not in the real cache
    cases = {"default": None, "path": str(tmp_path / "mine"), "off": ""}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(cases), str(tmp_path / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(line[0].removeprefix("RESULTS"))
    home = str(tmp_path / "home")
    assert got["default"] is None, got  # auto is off on CPU (GPU/TPU: under `home`)
    assert not os.path.exists(os.path.join(home, ".cache", "hybridjax"))
    assert got["path"] == str(tmp_path / "mine")
    assert got["off"] is None
