"""The wheels the GPU machine's image lacks: what hybridjax and the GPU check import, minus what
the image holds (`image_packages.txt`), with their dependencies minus the image's again; and the
requirements of the CPU stand-in of that image (`standin_requirements`).

    python experiments/gpu/wheels.py --dest experiments/gpu/wheels

Needed: `[project].dependencies` of pyproject.toml and the check's own (`CHECK_NEEDS`, each
with the version the `test` extra pins, e.g. `trl==1.16.0`). Every needed package the image
lacks is downloaded without its dependencies (`pip download --no-deps --only-binary=:all:` for
CPython 3.12, manylinux x86_64); its `Requires-Dist` lines, evaluated for that interpreter and
platform (with the extras asked for), name the next ones to fetch; a package the image holds
is not fetched, but the extras asked of it are followed through its metadata. Standard library
only, besides `packaging` (or pip's copy of it), so any Python ≥ 3.11 with pip runs it.

`DEST/image_requirements.txt` then lists the stand-in's requirements: the image's packages that
hybridjax, the check and the carried wheels require (`jaxlib` beside `jax`), each at most at
the image's version where one is known (`==` for jax and jaxlib: the stand-in exists to run
the image's JAX), without torch and what requires it (`NOT_IN_STANDIN`): PyPI's default torch
wheel for Python 3.12 is a multi-GB CUDA build, so the stand-in has none and the torch steps
report a skip.

Raises SystemExit with pip's last line when a download fails.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import tomllib
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare interpreter: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECK_NEEDS = ("pytest", "transformers", "trl")  # the gpu tests, parity, TRL's GRPO step
NOT_IN_STANDIN = ("torch", "accelerate")  # torch and what requires it
PIP_TARGET = [
    "--only-binary=:all:",
    "--python-version=3.12",
    "--implementation=cp",
    "--abi=cp312",
    *(f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "linux_x86_64")),
]
# PEP 508 marker environment of the image's interpreter (CPython 3.12.3 on Linux x86_64)
MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


def image_packages(path: pathlib.Path = HERE / "image_packages.txt") -> dict[str, str]:
    """canonical name → version ("" where unknown) of `image_packages.txt`."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def needed(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """pyproject's dependencies plus `CHECK_NEEDS`, as pinned in its `test` extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    test = {
        canonicalize_name(Requirement(r).name): r for r in project["optional-dependencies"]["test"]
    }
    specs = [*project["dependencies"], *(test.get(n, n) for n in CHECK_NEEDS)]
    return [Requirement(s) for s in specs]


def requires(wheel: pathlib.Path, extras: set[str]) -> list[Requirement]:
    """The `Requires-Dist` of `wheel` that apply on the image with `extras` asked for."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.partition(":")[2].strip())
        if req.marker is None or any(
            req.marker.evaluate(MARKERS | {"extra": e}) for e in (extras or {""})
        ):
            out.append(req)
    return out


def download(req: Requirement, dest: pathlib.Path) -> pathlib.Path:
    """`pip download --no-deps` of `req` for the image into `dest`; the wheel's path."""
    spec = f"{req.name}{req.specifier}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", dest]
    done = subprocess.run([*map(str, cmd), spec], capture_output=True, text=True, check=False)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"wheels.py: pip could not download {spec}: {last}")
    name = canonicalize_name(req.name)
    found = [
        w
        for w in dest.glob("*.whl")
        if parse_wheel_filename(w.name)[0] == name
        and req.specifier.contains(str(parse_wheel_filename(w.name)[1]), prereleases=True)
    ]
    return max(found, key=lambda w: parse_wheel_filename(w.name)[1])


def fetch(dest: pathlib.Path) -> tuple[list[pathlib.Path], list[str]]:
    """Downloads what the image lacks (module docstring) into `dest`. Returns the wheels
    fetched and the image's packages that they or hybridjax require (canonical names)."""
    image = image_packages()
    dest.mkdir(parents=True, exist_ok=True)
    queue, seen, wheels, held = needed(), set(), [], []
    with tempfile.TemporaryDirectory() as scratch:
        while queue:
            req = queue.pop(0)
            key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
            if key in seen:
                continue
            seen.add(key)
            if key[0] in image:
                held.append(key[0])
                if req.extras:  # the image has it; what its extras need may be missing
                    wheel = download(req, pathlib.Path(scratch))
                    queue += [r for r in requires(wheel, set(req.extras)) if r.marker]
                continue
            wheel = download(req, dest)
            wheels.append(wheel)
            queue += requires(wheel, set(req.extras))
    return sorted(set(wheels)), list(dict.fromkeys(held))


def standin_requirements(held: list[str]) -> list[str]:
    """pip requirement lines of the stand-in (module docstring), given the image's packages
    that hybridjax and the carried wheels require (`fetch`'s second result)."""
    image = image_packages()
    out = []
    for name in dict.fromkeys([*held, "jaxlib"]):
        if name not in image or name in NOT_IN_STANDIN:
            continue
        version = image[name]
        op = "==" if name in ("jax", "jaxlib") else "<="
        out.append(f"{name}{op}{version}" if version else name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(HERE / "wheels"), help="folder of the wheels")
    dest = pathlib.Path(parser.parse_args().dest)
    wheels, held = fetch(dest)
    lines = standin_requirements(held)
    (dest / "image_requirements.txt").write_text("".join(f"{r}\n" for r in lines))
    stale = [w for w in dest.glob("*.whl") if w not in wheels]
    for w in stale:  # an older version or a package no longer needed
        w.unlink()
    (dest / "wheels.txt").write_text("".join(f"{w.name}\n" for w in wheels))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}:")
    print("\n".join(f"  {w.name}" for w in wheels))


if __name__ == "__main__":
    main()
