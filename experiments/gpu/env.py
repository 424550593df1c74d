"""Step `env`: the interpreter, every package hybridjax and the check import (version, imported
or why not), the devices with their `memory_stats()` keys, `nvidia-smi`, the JAX APIs that moved
between our pinned JAX and the image's, and the two ceilings later steps divide by:

* the bf16 matmul peak: an N×N×N bf16 product (N = 8192 on GPU, 512 in a dry run), 2·N³ FLOPs
  over the best of 10 timed products after 3 warm-ups;
* the copy bandwidth: a device-to-device copy of a 2 GiB array (16 MiB in a dry run), bytes
  read plus written over the best of 10 timed copies.

On a GPU it fails when JAX sees none; everywhere, when a package hybridjax needs does not
import (the later steps would fail on it). Packages that hold other steps only (torch, trl)
are listed, and those steps say why they skip.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import subprocess
import sys
import time
import warnings

from experiments.gpu.step import ROOT, Context, main

# import name → distribution; `needed` ones must import
NEEDED = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "flax": "flax",
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "grain": "grain",
    "pyarrow": "pyarrow",
    "ml_collections": "ml-collections",
    "absl": "absl-py",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "jinja2": "jinja2",
    "numpy": "numpy",
    "tqdm": "tqdm",
    "tensorboardX": "tensorboardX",
    "matplotlib": "matplotlib",
    "httpx": "httpx",
    "pebble": "pebble",
    "yaml": "pyyaml",
    "pytest": "pytest",
}
OPTIONAL = {"transformers": "transformers", "torch": "torch", "trl": "trl", "datasets": "datasets"}
PROJECT = ("hybridjax.rl.trainer", "hybridjax.memory.planner", "experiments.benchmarks.throughput")
VENDOR = {"bf16 matmul": 990e12, "copy": 4.8e12}  # H200 SXM datasheet: dense bf16, HBM3e


def _import(module: str, dist: str) -> list:
    try:
        importlib.import_module(module)
        status = "ok"
    except Exception as err:  # any import error is the answer, not a crash of the step
        status = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return [module, version, status]


def _best_seconds(fn, *args, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(dry_run: bool) -> dict:
    """{"bf16_matmul_flops": FLOP/s, "copy_bytes_per_s": bytes/s} of the default device."""
    import jax
    import jax.numpy as jnp

    n = 512 if dry_run else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2.0 * n**3 / _best_seconds(matmul, a)
    words = (16 if dry_run else 2048) * 2**20 // 4
    x = jnp.ones((words,), jnp.float32)
    copy = jax.jit(lambda y: y + 1.0)  # one read, one write per element
    bandwidth = 2.0 * 4 * words / _best_seconds(copy, x)
    return {"bf16_matmul_flops": flops, "copy_bytes_per_s": bandwidth}


def _jax_apis() -> list[list]:
    import jax

    rows = []
    for name, where in (("shard_map", "jax"), ("shard_map", "jax.experimental.shard_map")):
        try:
            with warnings.catch_warnings():  # the old place warns that it is deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                ok = hasattr(importlib.import_module(where), name)
        except ImportError:
            ok = False
        rows.append([f"{where}.{name}", "present" if ok else "absent"])
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    rows.append(["memory_stats() keys", ", ".join(sorted(stats)) or "none (CPU)"])
    return rows


def _nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        return "not found"
    query = "--query-gpu=name,memory.total,driver_version,clocks.max.sm"
    done = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return (done.stdout or done.stderr).strip()


def _not_in_image() -> list[str]:
    """Installed distributions the GPU image lacks and the wheels do not carry (the stand-in
    should show none)."""
    from experiments.gpu.wheels import canonicalize_name, image_packages

    listed = ROOT / "experiments" / "gpu" / "wheels" / "wheels.txt"
    carried = listed.read_text().split() if listed.is_file() else []
    known = set(image_packages()) | {canonicalize_name(w.split("-")[0]) for w in carried}
    installed = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    return sorted(installed - known - {"hybridjax"})


def _listed(names: list[str], most: int = 12) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more if names else "none"


def run(ctx: Context) -> None:
    packages = [_import(m, d) for m, d in NEEDED.items()]
    ctx.table("packages hybridjax needs", ["module", "version", "import"], packages)
    optional = [_import(m, d) for m, d in OPTIONAL.items()]
    ctx.table("packages of the parity and TRL steps", ["module", "version", "import"], optional)
    project = [[m, _import(m, "hybridjax")[2]] for m in PROJECT]
    ctx.table("project modules", ["module", "import"], project)
    broken = [r[0] for r in packages + project if r[-1] != "ok"]
    if broken:
        raise RuntimeError(f"does not import: {', '.join(broken)} (see the tables above)")
    import jax

    devices = jax.devices()
    machine = [
        ["python", f"{sys.version.split()[0]} at {sys.executable}"],
        ["platform", platform.platform()],
        ["jax backend", jax.default_backend()],
        ["devices", ", ".join(f"{d.platform}:{d.device_kind}" for d in devices)],
        ["bytes_limit", (devices[0].memory_stats() or {}).get("bytes_limit")],
        ["nvidia-smi", _nvidia_smi()],
        ["not in the image", _listed(_not_in_image())],
        *_jax_apis(),
    ]
    ctx.table("machine", ["what", "here"], machine)
    if not ctx.dry_run and jax.default_backend() != "gpu":
        raise RuntimeError(f"JAX sees no GPU (backend {jax.default_backend()})")
    ceilings = measure_ceilings(ctx.dry_run)
    ctx.save(ceilings=ceilings, backend=jax.default_backend(), jax_version=jax.__version__)
    rows = [
        ["bf16 matmul TFLOP/s", ceilings["bf16_matmul_flops"] / 1e12, VENDOR["bf16 matmul"] / 1e12],
        ["copy TB/s (read + write)", ceilings["copy_bytes_per_s"] / 1e12, VENDOR["copy"] / 1e12],
    ]
    ctx.table("ceilings: measured, H200 datasheet", ["ceiling", "measured", "datasheet"], rows)


if __name__ == "__main__":
    main("env", run)
