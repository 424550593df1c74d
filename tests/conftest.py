"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

`HYBRIDJAX_TEST_PLATFORMS` (default `cpu`) sets `jax_platforms`; `experiments/gpu/check.sh` runs
the `gpu`-marked tests with `cuda,cpu`. Those tests are skipped where JAX has no GPU.
"""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "")
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
