"""Benchmark and job entry points (``python -m jobs.bench ...``)."""
