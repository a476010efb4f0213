"""Tests that need a CUDA device (``scripts/run-gpu-tests.sh``); skipped without one."""
