#!/usr/bin/env bash
# Downloads the wheels the GPU machine's image lacks into experiments/gpu/wheels (ignored by
# git; it travels with the working tree): hybridjax's dependencies and the check's own (pytest,
# transformers, trl), minus what experiments/gpu/image_packages.txt lists, with their
# dependencies minus the image's, for CPython 3.12 on manylinux x86_64. Run it on a machine
# with a network, from anywhere; PYTHON=... picks the interpreter (any Python >= 3.11 with pip).
#
#   experiments/gpu/fetch_wheels.sh [DEST]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" "$here/wheels.py" --dest "${1:-$here/wheels}"
