"""Step `tests`: the `gpu`-marked tests, collected from the test files that carry the marker
only (`gpu_test_files`: collecting the whole tree would import packages the GPU image lacks),
run with `jax_platforms=cuda,cpu` (`cpu` in a dry run, where they are collected and skipped).

Table: every test with its outcome and seconds (pytest's JUnit XML). Fails when a test fails or
errors, or when no `gpu` test is collected.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

from experiments.gpu.step import ROOT, Context, main

MARKER = "mark.gpu"  # `pytestmark = pytest.mark.gpu` or `@pytest.mark.gpu`


def gpu_test_files(root: pathlib.Path = ROOT) -> list[str]:
    """Paths (relative to `root`) of the test modules under `tests/` that use the gpu marker."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in (root / "tests").rglob("test_*.py")
        if MARKER in p.read_text()
    )


def junit_rows(xml: pathlib.Path) -> list[list]:
    """[test id, outcome, seconds] of every test case of a JUnit XML file (`[]` if missing)."""
    if not xml.is_file():
        return []
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                message = (found.get("message") or "").splitlines()[:1]
                outcome = f"{kind}: {message[0][:100]}" if message else kind
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        rows.append([name, outcome, float(case.get("time", 0.0))])
    return rows


def run(ctx: Context) -> None:
    files = gpu_test_files()
    xml = ctx.out / "tests.xml"
    env = os.environ | {"HYBRIDJAX_TEST_PLATFORMS": "cpu" if ctx.dry_run else "cuda,cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd += [*files, f"--junitxml={xml}"]
    ctx.save(files=files, command=" ".join(cmd[1:]))
    done = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    rows = junit_rows(xml)
    ctx.table("gpu-marked tests", ["test", "outcome", "seconds"], rows)
    bad = [r[0] for r in rows if r[1].startswith(("failure", "error"))]
    ctx.save(returncode=done.returncode, counted={"tests": len(rows), "failed": len(bad)})
    if not rows:
        raise RuntimeError(f"pytest collected no gpu test from {files} (exit {done.returncode})")
    if bad or done.returncode not in (0, 5):
        raise RuntimeError(f"{len(bad)} of {len(rows)} failed: {', '.join(bad)[:200]}")


if __name__ == "__main__":
    main("tests", run)
