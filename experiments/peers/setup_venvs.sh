#!/usr/bin/env bash
# Makes the peers' own virtualenvs under experiments/peers/.venvs/ (git-ignored); never
# project dependencies. torch is pinned to the CPU build's version: an unpinned torch pulls
# a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
mkdir -p .venvs
if [ ! -x .venvs/trl/bin/python ]; then
  "$PY" -m venv .venvs/trl
  .venvs/trl/bin/pip install -q "torch==2.13.0" trl transformers datasets
fi
if [ ! -x .venvs/tunix/bin/python ]; then
  "$PY" -m venv .venvs/tunix
  .venvs/tunix/bin/pip install -q google-tunix "jax[cpu]" transformers
fi
.venvs/trl/bin/python -c "import trl, torch; print('trl', trl.__version__, 'torch', torch.__version__)"
.venvs/tunix/bin/python -c "import importlib.metadata as m, jax; print('tunix', m.version('google-tunix'), 'jax', jax.__version__)"
