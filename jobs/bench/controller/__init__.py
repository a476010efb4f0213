"""The controller load benchmark (``python -m jobs.bench controller``):
:mod:`~jobs.bench.controller.cli` runs it, :mod:`~jobs.bench.controller.ranks` simulates the
ranks, :mod:`~jobs.bench.controller.load` drives the load, :mod:`~jobs.bench.controller.summary`
and :mod:`~jobs.bench.controller.stats` fold the measurements, :mod:`~jobs.bench.controller.report`
writes the report."""

__all__: list[str] = []
