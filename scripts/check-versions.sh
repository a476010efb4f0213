#!/usr/bin/env bash
# Run the core of the suite against one torch/Ray pair, in a throwaway venv under /tmp.
#
#   bash scripts/check-versions.sh TORCH RAY          # e.g. 2.8.0 2.56.0 (the floors)
#   VENV=/tmp/somewhere bash scripts/check-versions.sh 2.8.0 2.56.0
#
# The venv gets exactly torch==TORCH and ray[default,train,tune]==RAY, then raycomp from this
# checkout (editable, no extras: their own pins would move torch) with pytest and
# pytest-timeout, and runs CORE below: the compressors and their wire payloads, the DDP comm
# hook, the transports with what reaches torch.distributed, local steps, the per-step guard,
# and one real Ray Train fit (the ResNet example): 841 tests, 2-5 minutes on 2 cores.
# The pair that passed, and when, goes in docs/testing.md ("Tested versions"); pyproject's
# floors are the oldest pair there, and tests/test_versions.py checks that they agree.
#
# PyPI's torch for Linux is the CUDA build (it imports and runs on a machine without a GPU);
# the download is torch plus its nvidia-* wheels, a few GB. A pip config that caps torch
# (a constraint file) can be bypassed for this one venv with PIP_CONFIG_FILE=/dev/null.
set -euo pipefail
cd "$(dirname "$0")/.."

if (($# != 2)); then
    echo "usage: $0 TORCH_VERSION RAY_VERSION   (e.g. $0 2.15.0 2.60.0)" >&2
    exit 2
fi
TORCH=$1 RAY=$2
PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/raycomp-versions/torch-$TORCH-ray-$RAY}
INSTALL_TIMEOUT=${INSTALL_TIMEOUT:-1800}

CORE=(
    tests/test_compressors.py
    tests/test_hook.py
    tests/test_wire.py
    tests/test_collectives.py
    tests/test_local_steps.py
    tests/test_train_api.py
    tests/test_examples.py::test_own_resnet_on_ray_train
)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
echo "check-versions: installing torch==$TORCH ray==$RAY into $VENV"
timeout "$INSTALL_TIMEOUT" "${pip[@]}" install -q "torch==$TORCH" "ray[default,train,tune]==$RAY" \
    pytest pytest-timeout
# raycomp itself must accept the pair as installed: pip refuses (or would move torch/ray)
# if pyproject's ranges leave it out, so check that nothing but raycomp changes.
before=$("${pip[@]}" freeze --exclude-editable | grep -iE '^(torch|ray)==' | sort)
timeout "$INSTALL_TIMEOUT" "${pip[@]}" install -q -e .
after=$("${pip[@]}" freeze --exclude-editable | grep -iE '^(torch|ray)==' | sort)
if [ "$before" != "$after" ]; then
    echo "check-versions: installing raycomp changed torch/ray:" >&2
    diff <(echo "$before") <(echo "$after") >&2 || true
    exit 1
fi

"$VENV/bin/python" - <<'EOF'
import sys

import numpy
import ray
import torch

print(f"check-versions: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"ray {ray.__version__}, numpy {numpy.__version__}")
EOF
export RAY_USAGE_STATS_ENABLED=0 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=5 "${CORE[@]}"
