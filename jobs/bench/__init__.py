"""The benchmarks: ``python -m jobs.bench <benchmark> [options]`` (:mod:`jobs.bench.cli`).

* ``e2e`` (:mod:`jobs.bench.e2e`): time to target of every method on two Ray nodes over a
  throttled link (:mod:`jobs.bench.netns`, :mod:`jobs.bench.cluster`), judged against the
  goals table (:mod:`jobs.bench.e2e.goals`);
* ``kernels`` (:mod:`jobs.bench.kernels`): compress/decompress time and wire bytes;
* ``controller`` (:mod:`jobs.bench.controller`): the controller actor under simulated ranks;
* ``tune`` (:mod:`jobs.bench.tune`): a Ray Tune search over the e2e benchmark's link.

:mod:`jobs.bench.report` holds what every report shares (machine, tables, atomic writes).
"""

__all__: list[str] = []
