"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

`HYBRIDJAX_TEST_PLATFORMS` (default `cpu`) sets `jax_platforms`; `experiments/gpu/check.sh` runs
the `gpu`-marked tests with `cuda,cpu`. Those tests are skipped where JAX has no GPU.

JAX's persistent compilation cache is off unless `HYBRIDJAX_TEST_JAX_CACHE` names a folder (a
developer's warm reruns: a second run of the same tests then compiles little). It is off by
default, CI included, because XLA's CPU executable serializer (JAX 0.10) crashed the slow suite
with a segfault in `executable.serialize()` while writing entries, twice in fresh clones, and a
cold run (every CI run) gained nothing measurable from it. When on, it goes through environment
variables, so the runs the tests start as subprocesses share it; it is keyed on the program,
the JAX version and the flags, so a stale entry is never used.
"""

import gc
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
# Compiling is most of the suite's time (hundreds of tiny programs, about a second each), and most
# of a compile is LLVM optimising machine code that then runs for milliseconds: the tests ask
# XLA:CPU for less of it (about half the compile time). XLA's graph passes, fusions and buffers
# are a user's run's; only LLVM's optimisation of the loops is lighter. The deviceless
# XLA:GPU tests (experiments/gpu/aot_tests.sh) compile as a user's run does:
# HYBRIDJAX_TEST_FULL_OPTIMIZATION=1.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if os.environ.get("HYBRIDJAX_TEST_FULL_OPTIMIZATION") != "1":
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {TEST_XLA_FLAGS}".strip()
if os.environ.get("HYBRIDJAX_TEST_JAX_CACHE"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["HYBRIDJAX_TEST_JAX_CACHE"])
    # programs that took a second or more to compile (JAX's default), of any size; a size
    # limit turns on the cache's file lock (parallel workers and their runs share it)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
import jax  # noqa: E402

from tests.worker_recycling import (  # noqa: E402, F401  (hooks: the slow suite's recycled workers)
    pytest_addoption,
    pytest_configure,
    pytest_handlecrashitem,
    pytest_testnodedown,
    pytest_xdist_make_scheduler,
)

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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test file, drop JAX's compiled programs and tracing caches: one process runs
    the whole slow suite (and an xdist worker half the fast one), and XLA's CPU compiler
    segfaulted twice, at the same point of the slow suite, in a test that passes alone, after
    25 minutes of programs accumulating in the process."""
    yield
    jax.clear_caches()
    gc.collect()
