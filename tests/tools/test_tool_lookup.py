"""A tool config's `class_name` imports nothing before it is allowed: a module planted in the
current directory is never imported (its import-time code never runs), and a module on the
configured path is imported only when its source defines the class."""

import sys

import pytest

from hybridjax.tools import load_tools

PLANTED = """
open({mark!r}, "w").write("imported")
from hybridjax.tools import Tool
class Evil(Tool):
    default_schema = {{"type": "function", "function": {{"name": "evil"}}}}
"""
CHOICES = "['calculator', 'python', 'sandbox_fusion']"


def _plant(directory, module, mark):
    (directory / f"{module}.py").write_text(PLANTED.format(mark=str(mark)))


def _config(tmp_path, class_name):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {class_name}\n")
    return path


@pytest.fixture
def cwd_on_path(tmp_path, monkeypatch):
    """The current directory is tmp_path/cwd, first on sys.path as `python -c`/`-m` put it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", ["", str(cwd), *sys.path])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield cwd
    for name in ("planted_tools", "shadowed_tools", "listed_tools"):
        sys.modules.pop(name, None)


def test_a_module_planted_in_the_current_directory_is_not_imported(tmp_path, cwd_on_path):
    mark = tmp_path / "side_effect"
    _plant(cwd_on_path, "planted_tools", mark)
    with pytest.raises(ValueError) as e:
        load_tools(_config(tmp_path, "planted_tools.Evil"))
    message = str(e.value)
    assert not mark.exists() and "\n" not in message
    assert "class_name 'planted_tools.Evil'" in message and CHOICES in message
    assert "no module 'planted_tools' found" in message and "PYTHONPATH" in message


def test_a_module_in_a_pythonpath_directory_is_allowed(tmp_path, cwd_on_path, monkeypatch):
    listed, mark = tmp_path / "listed", tmp_path / "side_effect"
    listed.mkdir()
    _plant(listed, "listed_tools", mark)
    monkeypatch.setenv("PYTHONPATH", str(listed))
    monkeypatch.setattr(sys, "path", [*sys.path, str(listed)])
    with pytest.raises(ValueError, match="'listed_tools' defines no 'Missing'"):
        load_tools(_config(tmp_path, "listed_tools.Missing"))
    assert not mark.exists()  # refused from its source, before any import
    (tool,) = load_tools(_config(tmp_path, "listed_tools.Evil"))
    assert tool.name == "evil" and mark.read_text() == "imported"


def test_the_current_directory_is_searched_when_pythonpath_names_it(
    tmp_path, cwd_on_path, monkeypatch
):
    _plant(cwd_on_path, "listed_tools", tmp_path / "side_effect")
    monkeypatch.setenv("PYTHONPATH", str(cwd_on_path))
    (tool,) = load_tools(_config(tmp_path, "listed_tools.Evil"))
    assert tool.name == "evil"


def test_a_module_shadowed_from_the_current_directory_is_refused(
    tmp_path, cwd_on_path, monkeypatch
):
    listed, mark = tmp_path / "listed", tmp_path / "side_effect"
    listed.mkdir()
    _plant(listed, "shadowed_tools", tmp_path / "listed_side_effect")
    _plant(cwd_on_path, "shadowed_tools", mark)
    monkeypatch.setenv("PYTHONPATH", str(listed))
    monkeypatch.setattr(sys, "path", [*sys.path, str(listed)])
    with pytest.raises(ValueError, match=r"would be imported from .*cwd/shadowed_tools.py"):
        load_tools(_config(tmp_path, "shadowed_tools.Evil"))
    assert not mark.exists() and not (tmp_path / "listed_side_effect").exists()


@pytest.mark.parametrize(
    "class_name, reason",
    [
        ("antigravity.Browser", "'antigravity' defines no 'Browser'"),  # would open a browser
        ("antigravity.webbrowser", "'antigravity' defines no 'webbrowser'"),  # a module it imports
        ("json.JSONDecoder", "JSONDecoder is not a subclass of hybridjax.tools.Tool"),
        ("web_search", "not a dotted path"),
        ("no_such_package.Tool", "no module 'no_such_package' found"),
    ],
)
def test_refusals_are_one_line_with_the_choices(tmp_path, class_name, reason):
    with pytest.raises(ValueError) as e:
        load_tools(_config(tmp_path, class_name))
    message = str(e.value)
    assert "\n" not in message and reason in message and CHOICES in message
    assert "antigravity" not in sys.modules


def test_a_planted_module_is_not_imported_by_a_fresh_interpreter(tmp_path):
    """As a user runs it: `python -c`/`-m` put the current directory first on sys.path."""
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mark = tmp_path / "side_effect"
    _plant(tmp_path, "planted_tools", mark)
    _config(tmp_path, "planted_tools.Evil")
    code = "from hybridjax.tools import load_tools\nload_tools('tools.yaml')"
    env = os.environ | {"PYTHONPATH": repo}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert done.returncode != 0 and not mark.exists()
    assert "ValueError: tools.yaml: tools[0]: class_name 'planted_tools.Evil'" in done.stderr


def test_an_allowed_module_that_fails_at_import_is_refused_in_one_line(
    tmp_path, cwd_on_path, monkeypatch
):
    """Its import-time code raising anything (not only ImportError), or exiting, is one line."""
    listed = tmp_path / "listed"
    listed.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(listed))
    monkeypatch.setattr(sys, "path", [*sys.path, str(listed)])
    for body, error in [("raise RuntimeError('flag defined twice\\nsecond line')", "RuntimeError"),
                        ("raise SystemExit(3)", "SystemExit")]:  # fmt: skip
        (listed / "listed_tools.py").write_text(f"class Evil:\n    pass\n{body}\n")
        sys.modules.pop("listed_tools", None)
        with pytest.raises(ValueError) as e:
            load_tools(_config(tmp_path, "listed_tools.Evil"))
        message = str(e.value)
        assert "\n" not in message and f"importing 'listed_tools' failed: {error}" in message


def test_the_running_program_is_not_imported_again(tmp_path, cwd_on_path, monkeypatch):
    """`python -m pkg.main` runs pkg/main.py as __main__; `pkg.main.X` would run it again."""
    listed, mark = tmp_path / "listed", tmp_path / "side_effect"
    listed.mkdir()
    _plant(listed, "listed_tools", mark)
    monkeypatch.setenv("PYTHONPATH", str(listed))
    monkeypatch.setattr(sys, "path", [*sys.path, str(listed)])
    main = type(sys)("__main__")
    main.__file__ = str(listed / "listed_tools.py")
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ValueError, match="'listed_tools' is the running program"):
        load_tools(_config(tmp_path, "listed_tools.Evil"))
    assert not mark.exists()
