"""The GPU check's pieces that run anywhere: the report's tables, the test selection, the wheel
resolver's markers and the stand-in's requirements, a step that dies or runs out of time, the
shell script's arguments, and collection of the gpu tests without the packages the GPU image
lacks. The whole check in its CPU stand-in: test_gpu_standin.py (slow)."""

import json
import pathlib
import subprocess
import sys
import zipfile

from experiments.gpu import check, report, tests, wheels

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_table_aligns_its_columns_and_pads_a_short_row():
    table = {"title": "t", "columns": ["pages", "kernel", "ms"], "rows": [[4, "jnp", 1.23456]]}
    table["rows"].append([4, "pallas"])  # skipped: no cells after the status
    lines = report.format_table(table).splitlines()
    assert lines[0] == "  t"
    assert lines[1].split() == ["pages", "kernel", "ms"]
    assert lines[3].split() == ["4", "jnp", "1.235"]  # 4 significant digits
    assert lines[4].split() == ["4", "pallas"]
    assert len({line.index("kernel") for line in lines[1:2]}) == 1
    skipped = {"step": "parity", "status": "skipped", "why": "no torch here", "seconds": 1.04}
    assert report.status_line(skipped) == "[parity] skipped (1.0 s): no torch here"


def test_the_gpu_tests_are_the_marked_files_and_junit_outcomes_read_back(tmp_path):
    files = tests.gpu_test_files()
    assert "tests/gpu/test_gpu.py" in files
    assert all(tests.MARKER in (ROOT / f).read_text() for f in files)
    assert '"gpu: ' in (ROOT / "pyproject.toml").read_text()  # a declared marker
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="a" name="x" time="1.5"/>'
        '<testcase classname="a" name="y" time="0"><skipped message="needs a GPU"/></testcase>'
        '<testcase classname="a" name="z" time="2"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert tests.junit_rows(xml) == [
        ["a::x", "passed", 1.5],
        ["a::y", "skipped: needs a GPU", 0.0],
        ["a::z", "failure: boom", 2.0],
    ]
    assert tests.junit_rows(tmp_path / "missing.xml") == []


def _wheel(tmp_path, lines):
    path = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\n" + "".join(f"{x}\n" for x in lines))
    return path


def test_wheel_requirements_follow_the_images_interpreter_and_the_extras_asked(tmp_path):
    wheel = _wheel(
        tmp_path,
        [
            "Requires-Dist: numpy",
            'Requires-Dist: array-record>=0.8; sys_platform != "win32"',
            'Requires-Dist: tomli; python_version < "3.11"',
            'Requires-Dist: pywin32; sys_platform == "win32"',
            'Requires-Dist: rich; extra == "cli"',
        ],
    )
    names = lambda reqs: [r.name for r in reqs]
    assert names(wheels.requires(wheel, set())) == ["numpy", "array-record"]
    assert names(wheels.requires(wheel, {"cli"})) == ["numpy", "array-record", "rich"]


def test_what_the_image_lacks_and_what_the_standin_installs():
    image = wheels.image_packages()
    assert image["jax"] == "0.11.2" and image["torch"] == "2.11.0" and image["flax"] == ""
    needed = {r.name: str(r.specifier) for r in wheels.needed()}
    assert needed["trl"] == "==1.16.0"  # the test extra's pin
    lacking = {wheels.canonicalize_name(n) for n in needed} - set(image)
    assert {"grain", "ml-collections", "pebble", "tensorboardx", "trl"} <= lacking
    assert wheels.standin_requirements(["jax", "numpy", "flax", "torch", "accelerate"]) == [
        "jax==0.11.2",
        "numpy<=2.5.2",
        "flax",
        "jaxlib==0.11.2",
    ]


def test_a_step_that_dies_or_runs_out_of_time_is_failed_with_why(tmp_path):
    died = check.run_step("no_such_step", tmp_path, True, 60)
    assert died["status"] == "failed" and "No module named" in died["why"]
    assert died["why"].startswith("exit status 1: ")
    slow = check.run_step("env", tmp_path, True, 0.01)
    assert slow["status"] == "failed" and slow["why"].startswith("timed out after 0 s")
    assert (tmp_path / "env.log").is_file()


def test_the_report_merges_every_part_and_is_not_ok_with_a_failure(tmp_path):
    ok = {"step": "env", "status": "ok"}
    check.write_report(tmp_path, "part1", {"part": "part1", "steps": {"env": ok}})
    bad = {"step": "kernels", "status": "failed", "why": "x"}
    check.write_report(tmp_path, "part2", {"part": "part2", "steps": {"kernels": bad}})
    merged = json.loads((tmp_path / "check.json").read_text())
    assert list(merged["steps"]) == ["env", "kernels"] and set(merged["parts"]) == set(check.PARTS)
    assert merged["ok"] is False


def test_check_script_parses_and_refuses_bad_arguments():
    script = ROOT / "experiments" / "gpu" / "check.sh"
    for name in ("check.sh", "fetch_wheels.sh", "standin.sh"):
        subprocess.run(["bash", "-n", str(script.with_name(name))], check=True)
    done = subprocess.run(["bash", str(script), "--nope"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown argument '--nope'" in done.stderr
    done = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True)
    assert done.returncode == 2 and "say part1, part2 or all" in done.stderr


def test_collecting_the_gpu_tests_imports_nothing_the_gpu_image_lacks():
    # the check collects only the marked files; those, and the check's orchestration, must
    # import without the wheels (tensorboardX, grain, ...), which a broken install may lack
    lacking = ("tensorboardX", "grain", "ml_collections", "pebble", "trl")
    code = (
        "import sys; sys.path[:0] = ['tests/gpu', 'tests/models']; import test_gpu; "
        "import experiments.gpu.check, experiments.gpu.tests, experiments.gpu.step; "
        f"print([m for m in {lacking!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_every_hybridjax_name_the_check_imports_exists():
    """The steps import hybridjax inside their functions (the image may lack a package until a
    step needs it), so a moved name fails only on the GPU machine: check them all here."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "experiments" / "gpu").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridjax"):
                module = importlib.import_module(node.module)
                missing += [
                    f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name)
                    and not (  # a submodule of a package
                        hasattr(module, "__path__")
                        and importlib.util.find_spec(f"{node.module}.{a.name}")
                    )
                ]
    assert not missing, missing
