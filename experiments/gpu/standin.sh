#!/usr/bin/env bash
# The CPU stand-in of the GPU machine: a Python 3.12 virtualenv with JAX 0.11.2 (CPU) holding
# only packages the GPU image has (versions at most the image's; no torch, so the parity and
# TRL steps skip), plus the wheels fetch_wheels.sh carries, installed as check.sh installs them
# on the GPU; then the whole check in dry-run mode (tiny shapes, CPU). The wheels come first:
# the image's packages that they need go into the virtualenv too (experiments/gpu/wheels.py).
# The virtualenv is cached in experiments/gpu/.standin (ignored by git) and rebuilt when its
# requirements change; the wheels are fetched again when pyproject.toml, the image's list or
# wheels.py is newer than them.
#
#   experiments/gpu/standin.sh [--out DIR]     # default results/gpu_check_standin
#   PYTHON312=/path/to/python3.12 picks the interpreter (else python3.12 on PATH, then pyenv's)
set -euo pipefail
cd "$(dirname "$0")/../.."
here=experiments/gpu
find_python312() {
  local c
  for c in "${PYTHON312:-}" "$(command -v python3.12 || true)" \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
      /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [[ -n "$c" && -x "$c" ]] && "$c" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "standin.sh: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  return 1
}
py312="$(find_python312)"
wheels="$here/wheels"
if [[ ! -f "$wheels/image_requirements.txt" || pyproject.toml -nt "$wheels/wheels.txt" ||
      "$here/image_packages.txt" -nt "$wheels/wheels.txt" || "$here/wheels.py" -nt "$wheels/wheels.txt" ]]; then
  PYTHON="$py312" "$here/fetch_wheels.sh" "$wheels"
fi
venv="$here/.standin/venv"
req="$wheels/image_requirements.txt"
if [[ ! -f "$venv/.ready" ]] || ! cmp -s "$req" "$venv/.ready"; then
  echo "standin.sh: building $venv with $py312" >&2
  rm -rf "$venv"
  "$py312" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
  cp "$req" "$venv/.ready"
fi
out="results/gpu_check_standin"
[[ "${1:-}" == "--out" && -n "${2:-}" ]] && out="$2"
PYTHON="$venv/bin/python" exec "$here/check.sh" all --dry-run --out "$out"
