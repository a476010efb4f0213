#!/usr/bin/env bash
# The checks too long for the default suite (results in docs/testing.md): the shipped
# Fashion-MNIST job's accuracy, the fault and resume drills, the Lightning and Hugging Face
# guard-and-resume runs, the Tune search, Ray Jobs and the real Prometheus. Run before a
# release; about 25 minutes on 2 cores.
# Extra arguments go to pytest (e.g. -x, -k fashion).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec .venv/bin/python -m pytest -q -s -m long "$@"
