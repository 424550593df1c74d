"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

`HYBRIDJAX_TEST_PLATFORMS` (default `cpu`) sets `jax_platforms`; `experiments/gpu/check.sh` runs
the `gpu`-marked tests with `cuda,cpu`. Those tests are skipped where JAX has no GPU.

JAX's persistent compilation cache is on, in `.jax_cache/` at the repository's root (git ignores
it) unless `HYBRIDJAX_TEST_JAX_CACHE` names another folder (`""` turns it off). The run's two
workers and its phases share it, and so do the runs the tests start as subprocesses (it goes
through environment variables): a program compiled once, by any test, is loaded by the next that
builds it (a new engine or trainer jits its programs afresh, and every test file ends by dropping
the process's compiled programs). It is keyed on the program, the JAX version and the flags, so a
stale entry is never used. Programs that compiled in under half a second are not written.
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
_JAX_CACHE = os.environ.get(
    "HYBRIDJAX_TEST_JAX_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"),
)
if _JAX_CACHE:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
    # a size limit turns on the cache's file lock (parallel workers and their runs share it)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
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
    """After each test file, drop JAX's compiled programs and tracing caches. Each XLA:CPU
    executable a process keeps holds memory maps of its own (about 33 for a small program), and
    a process near `vm.max_map_count` (65,530) dies inside XLA's compiler or serializer with
    SIGSEGV: a worker of the fast suite, and the slow suite in one process, used to pile up
    programs until it did (`experiments/xla_memory_maps.py` reproduces it in seconds). The
    persistent cache above gives the next file's programs back without compiling them."""
    yield
    jax.clear_caches()
    gc.collect()
