"""Moved: the worker loop now lives in :mod:`raycomp.train` (``TrainLoop``, composed of small
parts). Kept for ``jobs.bench_controller``, which mirrors the workers' backpressure."""

from raycomp.train.reporter import MAX_REPORTS_IN_FLIGHT

__all__ = ["MAX_REPORTS_IN_FLIGHT"]
