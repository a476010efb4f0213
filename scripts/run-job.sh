#!/usr/bin/env bash
# The main job of README.md: set up (idempotent), then train the Fashion-MNIST CNN with
# gradient compression as a Ray Train job on an embedded local Ray, under the adaptive default
# policy planning for a 100 Mbit/s link (jobs/configs/fashion_mnist.yaml says why: on this
# machine's loopback it would rightly stay dense). It prints the link it plans for and, at the
# end, what the policy chose and why.
# Extra arguments are passed on, e.g. `bash scripts/run-job.sh workload.epochs=1`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m jobs.train --config jobs/configs/fashion_mnist.yaml "$@"
