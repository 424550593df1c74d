#!/usr/bin/env bash
# The GPU check, from the repository root, with no network: two commands of at most 8 minutes.
#
#   experiments/gpu/check.sh part1            # env, gpu tests, parity, GRPO on a 0.5B shape
#   experiments/gpu/check.sh part2            # kernels, TRL's GRPOTrainer
#   experiments/gpu/check.sh all --dry-run    # CPU, tiny shapes: checks the check itself
#   options: --out DIR (default results/gpu_check), --budget SECONDS (per part, default 450)
#   PYTHON=... picks the interpreter (default python3, the GPU image's, which holds torch)
#
# Packages the image lacks come from experiments/gpu/wheels (experiments/gpu/fetch_wheels.sh,
# on a machine with a network): installed into experiments/gpu/.site with `pip install
# --no-index --no-deps --target` (again when the wheels change), then put on PYTHONPATH.
# GPU_CHECK_WHEELS / GPU_CHECK_SITE move either folder. Steps and results: experiments/gpu/check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-experiments/gpu/wheels}"
SITE="${GPU_CHECK_SITE:-experiments/gpu/.site}"
part=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    part1|part2|all) part="$1" ;;
    --dry-run) args+=("--dry-run") ;;
    --out|--budget) [[ $# -ge 2 ]] || { echo "check.sh: $1 needs a value" >&2; exit 2; }
      args+=("$1" "$2"); shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$part" ]] || { echo "check.sh: say part1, part2 or all (see --help)" >&2; exit 2; }
if [[ " ${args[*]-} " != *" --dry-run "* ]] && ! nvidia-smi >/dev/null 2>&1; then
  echo "check.sh: no NVIDIA GPU here (nvidia-smi failed); --dry-run checks the script on CPU" >&2
  exit 1
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  listing="$(cd "$WHEELS" && ls -- *.whl)"
  if [[ ! -f "$SITE/.installed" || "$(cat "$SITE/.installed")" != "$listing" ]]; then
    rm -rf "$SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check \
      --target "$SITE" "$WHEELS"/*.whl
    echo "$listing" >"$SITE/.installed"
  fi
  export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "check.sh: no wheels in $WHEELS (experiments/gpu/fetch_wheels.sh); using what is installed" >&2
fi
exec "$PYTHON" -m experiments.gpu.check "$part" "${args[@]}"
