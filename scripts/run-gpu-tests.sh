#!/usr/bin/env bash
# The GPU tests (tests/gpu), on a machine with a CUDA device. They need torch, pytest and
# this checkout, nothing else (no Ray, pydantic or PyYAML, no virtual environment), so they
# run with whatever Python holds torch there (PYTHON, default python3).
# RAYCOMP_GPU_NOTES=FILE also writes what the tests measured to FILE (JSON).
# Extra arguments go to pytest (e.g. -x, -k ddp, tests/gpu/test_codec.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: torch.cuda.is_available() is False")'
paths=(tests/gpu)
for arg in "$@"; do [[ $arg == tests/* ]] && paths=(); done
exec "${PYTHON:-python3}" -m pytest -q -m gpu -p no:cacheprovider "${paths[@]}" "$@"
