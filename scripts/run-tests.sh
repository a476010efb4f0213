#!/usr/bin/env bash
# The test command of README.md (and of CI): set up, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec .venv/bin/python -m pytest -q "$@"
