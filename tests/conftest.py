"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

`HYBRIDJAX_TEST_PLATFORMS` (default `cpu`) sets `jax_platforms`; `experiments/gpu/check.sh` runs
the `gpu`-marked tests with `cuda,cpu`. Those tests are skipped where JAX has no GPU.

Compiled programs go to JAX's persistent compilation cache (`.jax_cache/` at the repository root,
or `HYBRIDJAX_TEST_JAX_CACHE`), through environment variables so the runs the tests start as
subprocesses share it: most tests build the same tiny models, so a program that took a second
or more to compile is loaded by every later test, process and suite. The cache is keyed on the
program, the JAX version and the flags, so a stale entry is never used.
"""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.environ.get("HYBRIDJAX_TEST_JAX_CACHE", _CACHE)
)
# only programs that took a second or more to compile (JAX's default): writing every one
# (threshold 0, about 10,000 entries a CI run) once crashed XLA's CPU executable serializer
# (a segfault in `executable.serialize()` in the slow suite), and fewer writes make it rarer
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# a size limit turns on the cache's file lock: parallel test workers and the runs they start
# read and write it at once (least recently used entries go past 4 GiB)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_platforms", os.environ.get("HYBRIDJAX_TEST_PLATFORMS", "cpu"))


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a GPU (experiments/gpu/check.sh runs these)")
        for item in gpu:
            item.add_marker(skip)
