#!/usr/bin/env bash
# The main job of README.md: set up, then train with compressed gradients on a local cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m jobs.demo "$@"
