"""A benchmark whose library or peer is missing stops with the command that installs it."""

import sys

import pytest
from ml_collections import ConfigDict

from experiments.benchmarks import requirements, run


def test_missing_library_names_the_bench_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    (message,) = requirements.problems("generation")
    assert "'transformers'" in message and "pip install -e '.[bench]'" in message
    cfg = ConfigDict(dict(benchmark="generation", generation={}, results_root=str(tmp_path)))
    with pytest.raises(requirements.MissingRequirement, match=r"\.\[bench\]"):
        run.run_benchmark(cfg)
    assert not list(tmp_path.iterdir())  # stopped before writing anything
    assert requirements.problems("throughput") == []


def test_missing_peer_venv_names_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.setattr(requirements, "PEER_VENVS", tmp_path / ".venvs")
    problems = requirements.problems("peers", ("trl", "hybridjax"))
    assert len(problems) == 1 and "'trl'" in problems[0]
    assert "bash experiments/peers/setup_venvs.sh" in problems[0]
    (tmp_path / ".venvs" / "trl" / "bin").mkdir(parents=True)
    (tmp_path / ".venvs" / "trl" / "bin" / "python").touch()
    assert requirements.problems("peers", ("trl", "hybridjax")) == []
