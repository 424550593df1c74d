"""What the sandbox guarantees, stated so it holds wherever the interpreter lives (a virtualenv
in the clone, under the home directory, under /tmp, in a path with spaces):

  * nothing outside the sandbox is readable but what it mounts on purpose: the system's
    program directories, `/etc/ld.so.cache`, its own `/proc` and `/dev`, and the interpreter's
    prefixes (its virtualenv and the base installation); the directories that lead to those
    are visible, and hold nothing else;
  * nothing is writable but its private `/work`, `/tmp` and `/dev/shm`, which start empty
    (but for the way to an interpreter that lives under one of them).

The walk runs inside the sandbox and reports every entry it finds outside those roots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hybridjax.tools.sandbox import run_python

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache", "/proc", "/dev"]
PRIVATE = ["/work", "/tmp", "/dev/shm"]

WALK = """
import json, os, sys
mounted, private = {mounted!r}, {private!r}
def inside(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)
readable, writable, dirs, listed, stack = [], [], [], [], ["/"]
while stack:
    d = stack.pop()
    dirs.append(d)
    try:
        open(os.path.join(d, ".probe"), "w").close()
        writable.append(d)
    except OSError:
        pass
    for entry in os.scandir(d):
        if entry.is_dir(follow_symlinks=False):
            if inside(entry.path, private):
                listed += [os.path.join(entry.path, name) for name in os.listdir(entry.path)]
                try:
                    open(os.path.join(entry.path, ".probe"), "w").close()
                except OSError:
                    readable.append(entry.path + " (not writable)")
            elif not inside(entry.path, mounted):
                stack.append(entry.path)
        elif not inside(entry.path, mounted) and not entry.is_symlink():
            readable.append(entry.path)
for root in mounted:
    if os.path.isdir(root) and not inside(root, private):
        try:
            open(os.path.join(root, ".probe"), "w").close()
            writable.append(root)
        except OSError:
            pass
print(json.dumps({{"readable": readable, "writable": writable, "dirs": dirs,
                  "listed": listed, "prefix": sys.prefix}}))
"""


def _prefixes() -> list[str]:
    named = {sys.prefix, sys.base_prefix}
    return sorted(named | {os.path.realpath(p) for p in named})


def _ancestors(paths: list[str]) -> set[str]:
    found = {"/"}
    for path in paths:
        while path not in ("/", ""):
            path = os.path.dirname(path)
            found.add(path)
    return found


def check_walk() -> None:
    """Runs the walk in the sandbox with this interpreter; asserts the guarantees above."""
    prefixes = _prefixes()
    code = WALK.format(mounted=SYSTEM + prefixes, private=PRIVATE)
    rc, out, err = run_python(code, timeout_s=30)
    assert rc == 0, err
    seen = json.loads(out)
    assert seen["prefix"] == sys.prefix  # it ran with this layout's interpreter
    assert seen["readable"] == []
    assert seen["writable"] == []
    # the only directories outside the mounted roots lead to them (e.g. /root/.pyenv); a
    # private dir holds nothing else (a prefix under /tmp or /work is mounted over it)
    assert set(seen["dirs"]) <= _ancestors(prefixes) | {"/etc"}, seen["dirs"]
    assert set(seen["listed"]) <= _ancestors(prefixes) | set(prefixes), seen["listed"]


def test_this_interpreter():
    check_walk()


def _scratch(layout: str, stack) -> str:
    """A new directory for a virtualenv in `layout`, removed after the test."""
    parent, prefix = {
        "in-the-clone": (REPO, ".sandbox-venv-"),
        "under-home": (os.path.join(os.path.expanduser("~"), ".cache"), "sandbox-venv-"),
        "under-tmp": (tempfile.gettempdir(), "sandbox-venv-"),
        "path-with-spaces": (tempfile.gettempdir(), "a dir with spaces "),
    }[layout]
    try:
        os.makedirs(parent, exist_ok=True)
        path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        pytest.skip(f"cannot make a directory in {parent}: {e}")
    stack.callback(shutil.rmtree, path, ignore_errors=True)
    return path


@pytest.mark.parametrize("layout", ["in-the-clone", "under-home", "under-tmp", "path-with-spaces"])
def test_a_virtualenv_in_any_layout(layout, monkeypatch):
    import contextlib

    with contextlib.ExitStack() as stack:
        venv = os.path.join(_scratch(layout, stack), "venv")
        base = os.path.join(os.path.realpath(sys.base_prefix), "bin", "python3")
        subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        monkeypatch.setattr(sys, "prefix", venv)
        monkeypatch.setattr(sys, "executable", os.path.join(venv, "bin", "python"))
        check_walk()
