#!/usr/bin/env bash
# One-command GPU check: installs the gpu extra, runs the GPU-marked tests, the memory plan, the
# throughput and generation benchmarks on a Qwen2.5-0.5B-shaped random model, and writes one
# JSON (results/gpu_check_<UTC stamp>/check.json). Steps: experiments/gpu/check.py.
#
#   experiments/gpu/check.sh                # on a CUDA machine, from the repository root
#   experiments/gpu/check.sh --dry-run      # CPU, tiny sizes, no install: checks the script
#   experiments/gpu/check.sh --out DIR      # write into DIR instead
#   PYTHON=.venv/bin/python experiments/gpu/check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python}"
dry_run=0
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) dry_run=1; args+=("--dry-run") ;;
    --out) args+=("--out" "$2"); shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ $dry_run -eq 0 ]]; then
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi >/dev/null 2>&1; then
    echo "check.sh: no NVIDIA GPU here (nvidia-smi failed); --dry-run checks the script on CPU" >&2
    exit 1
  fi
  "$PYTHON" -m pip install -q -e '.[gpu,test,bench]'
fi
exec "$PYTHON" -m experiments.gpu.check "${args[@]}"
