"""The end-to-end benchmark (``python -m jobs.bench e2e``): time to target of every method on
two Ray nodes over a throttled link. :mod:`~jobs.bench.e2e.cli` runs it (its docstring says
how), :mod:`~jobs.bench.e2e.methods` builds each run's config, :mod:`~jobs.bench.e2e.driver`
trains inside the namespace, :mod:`~jobs.bench.e2e.traces` and :mod:`~jobs.bench.e2e.analysis`
turn the traces into results, :mod:`~jobs.bench.e2e.goals` (data) and
:mod:`~jobs.bench.e2e.judge` give the verdicts, :mod:`~jobs.bench.e2e.report` writes the files.
"""

__all__: list[str] = []
