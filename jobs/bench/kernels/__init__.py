"""The kernel micro-benchmark (``python -m jobs.bench kernels``): :mod:`~jobs.bench.kernels.cli`
runs it, :mod:`~jobs.bench.kernels.measure` times the compressors,
:mod:`~jobs.bench.kernels.report` writes the report and checks the targets."""

__all__: list[str] = []
