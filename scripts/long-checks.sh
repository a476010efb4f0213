#!/usr/bin/env bash
# The checks too long for the default suite (minutes each; results in docs/testing.md):
# the shipped Fashion-MNIST job's accuracy and compression ratio on a real local Ray.
# Extra arguments go to pytest (e.g. -x, -k fashion).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec .venv/bin/python -m pytest -q -s -m long "$@"
