#!/usr/bin/env bash
# Mutation check (docs/testing.md): break the code on purpose, one named mutant at a time,
# in a temporary copy of the repository, and check that the test suite notices.
# Mutants live in tests/mutants/catalog/; --list shows where each one's anchor is found.
#   scripts/mutants.sh [--list] [--only NAME]... [--baseline] [--keep] [--log-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_TRAIN_ENABLE_PRINT_PATCH=0
exec .venv/bin/python -m tests.mutants "$@"
