"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_platforms", "cpu")
