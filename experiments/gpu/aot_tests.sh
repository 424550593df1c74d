#!/usr/bin/env bash
# The deviceless GPU tests: XLA:GPU compiles the decode kernel, the update passes and a 0.5B GRPO
# and PPO step for compile-only A100s/H100s on this CPU machine (docs/gpu-planning.md).
#
# They need JAX's CUDA plugin (the `gpu-aot` extra, about 0.6 GB). It goes into its own
# virtualenv, .venv-aot, which sees .venv's packages through a .pth file and adds only the
# plugin's wheels: installed into .venv, the plugin would try to open a GPU in every JAX process
# the other tests start and print its failure on their stderr.
#
#   experiments/gpu/aot_tests.sh [PYTEST ARGS...]     # BASE_VENV=.venv by default
set -euo pipefail
cd "$(dirname "$0")/../.."
base=${BASE_VENV:-.venv}
aot=.venv-aot
if [ ! -x "$aot/bin/pip" ]; then
  "$base/bin/python" -m venv "$aot"
  purelib=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  "$aot/bin/python" - "$purelib" <<'PY'
import pathlib, sys, sysconfig
pth = pathlib.Path(sysconfig.get_path("purelib"), "base_venv.pth")
pth.write_text(f"import site; site.addsitedir({sys.argv[1]!r})\n")
PY
fi
jax=$("$aot/bin/python" -c 'import jax; print(jax.__version__)')
"$aot/bin/pip" install -q --disable-pip-version-check --no-deps \
  "jax-cuda12-plugin==$jax" "jax-cuda12-pjrt==$jax" "nvidia-cuda-nvcc-cu12>=12.9"
# XLA's full optimisation, as a user's compile (tests/conftest.py lowers it for the CPU tests)
# compile-only GPU programs stay out of the tests' persistent cache (tests/conftest.py)
HYBRIDJAX_TEST_JAX_CACHE= HYBRIDJAX_TEST_FULL_OPTIMIZATION=1 exec "$aot/bin/python" -m pytest -q --durations=10 -n 2 --dist loadfile -p no:cacheprovider \
  tests/rollout/test_kernel_gpu_compile.py tests/sharding/test_state_layout.py \
  tests/memory/test_gpu_plan.py tests/memory/test_gpu_targets.py \
  tests/rewards/test_reward_model_gpu_compile.py "$@"
