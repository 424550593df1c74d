"""Runs Python code as an unprivileged user with this checkout and this interpreter, so the
sandbox's limits are tested as most users meet them (CI runs as root, where the kernel skips
the per-user process limit and every cgroup is writable).

Already unprivileged: the code runs as this user. As root: as `nobody` (`setpriv`), in a
private mount namespace (`unshare --mount`) where the interpreter's prefixes and the checkout
are bind-mounted under a world-readable directory, since they may live where `nobody` cannot
go (a pyenv under a 0700 /root, a virtualenv in a home directory)."""

from __future__ import annotations

import os
import shlex
import shutil
import site
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534


def available() -> str:
    """'' where `run` works here, else why not."""
    if os.geteuid() != 0:
        return ""
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    return f"unshare --mount fails here: {probe.stderr.strip()}" if probe.returncode else ""


def run(code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Runs `code` (which may import hybridjax) unprivileged; returns the finished process
    (text stdout and stderr)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", "LANG": "C.UTF-8"}
    if os.geteuid() != 0:
        env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, sys.path)])
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout_s)  # fmt: skip
    base, prefix = os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)
    roots = [base, prefix, os.path.realpath(REPO)]
    # import paths outside those (a virtualenv whose packages come through a .pth file from
    # a directory the unprivileged user cannot read, as in CI's layout phase) are bound too
    inside = lambda path: any(path == r or path.startswith(r + os.sep) for r in roots)
    extra = list(dict.fromkeys(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)))
    roots += [p for p in extra if not inside(p)]
    top = tempfile.mkdtemp(prefix="unprivileged-", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        seen = [os.path.join(top, str(i)) for i in range(len(roots))]
        for path in seen:
            os.mkdir(path)
        moved = lambda path, i: os.path.join(seen[i], os.path.relpath(path, roots[i]))
        python = moved(os.path.realpath(sys.executable), 0)
        sites = [moved(os.path.realpath(p), 1) for p in site.getsitepackages()]
        sites += [seen[i] for i in range(3, len(roots))]
        preamble = (f"import site, sys\nfor p in {sites!r}: site.addsitedir(p)\n"
                    f"sys.path.insert(0, {seen[2]!r})\n")  # fmt: skip
        binds = " && ".join(f"mount --bind {shlex.quote(r)} {shlex.quote(s)}"
                            for r, s in zip(roots, seen, strict=True))  # fmt: skip
        drop = f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups --"
        script = f'{binds} && exec {drop} "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
        command += [python, "-c", preamble + code]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(top, ignore_errors=True)
