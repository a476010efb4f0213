#!/usr/bin/env bash
# The main job of README.md: set up (idempotent), then train the Fashion-MNIST CNN with
# adaptive gradient compression as a Ray Train job on an embedded local Ray.
# Extra arguments are passed on, e.g. `bash scripts/run-job.sh workload.epochs=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m jobs.train --config jobs/configs/fashion_mnist.yaml "$@"
