"""The overhead benchmark (``python -m jobs.bench overhead``): what the ``raycomp.train`` step
costs where it compresses nothing, against plain DDP. :mod:`~jobs.bench.overhead.cli` runs it
(its docstring says how), :mod:`~jobs.bench.overhead.worker` times the three sides on every
Ray Train worker, :mod:`~jobs.bench.overhead.summary` turns the block pairs into the median
ratio and its verdict, :mod:`~jobs.bench.overhead.report` writes the files.
"""

__all__: list[str] = []
