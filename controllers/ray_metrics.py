"""The controller's metrics through Ray's own metrics API (``ray.util.metrics``).

Ray users look at the Ray dashboard, at the Prometheus endpoint of each node's metrics
agent (``ray start --metrics-export-port``) and at Ray's Grafana. :class:`RayMetrics`
puts raycomp's catalogue there too, beside the standalone exporter
(:mod:`raycomp.controllers.exporter`), and from the same source: every tick it renders the
controller with the exporter's own :class:`~raycomp.controllers.exporter.ControllerCollector`
and records what that rendered into one Ray metric per catalogue entry
(:data:`raycomp._internal.observe.metrics.CATALOGUE`). A series therefore has the same labels and value in
both places, and a metric added to the catalogue appears in both.

Names: Ray prefixes a custom metric with ``ray_`` and appends ``_total`` to a counter, so a
counter is declared without its ``_total`` and every series is ``ray_`` + the catalogue's
name (``ray_raycomp_wire_bytes_total``, ``ray_raycomp_step_seconds_bucket``). Ray adds its
own labels (``WorkerId``, ``NodeAddress``, ``SessionName``, ...); the catalogue's labels are
declared as tag keys.

Ray's metrics are recorded, not rendered on demand, so:

* gauges are set to the rendered value at each tick;
* counters are incremented by the rendered total's growth since the previous tick (a total
  that went down, a run re-registered under the same id, counts from zero again); a series
  is created at 0 the first time it is seen, as the exporter shows it, so that its first
  increase is one (``increase``/``changes`` need a sample before the event);
* histograms observe each bucket's new observations: their mean when all of a tick's new
  observations lie in one bucket (count and sum exact, the usual case: step times are
  steady), else each bucket's midpoint. The counts are exact; the sum Ray serves is not:
  Ray's metrics agent (2.60) rebuilds a worker's histogram from its bucket counts at the
  buckets' midpoints, whatever was observed.

A series the controller stops rendering (a run evicted after its grace period) keeps the
last value it was given, as long as Ray keeps a value it was set to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from raycomp._internal.observe.metrics import CATALOGUE, STEP_BUCKETS, Metric

log = logging.getLogger("raycomp.controller")

#: how often the controller's state is recorded into Ray's metrics (Ray's agents export
#: every few seconds, ``metrics_report_interval_ms``; recording more often shows nothing more)
EVERY_S = 5.0

Labels = tuple[tuple[str, str], ...]


class Collector(Protocol):
    def collect(self) -> Iterable[Any]: ...


def ray_name(metric: Metric) -> str:
    """The name a catalogue metric is declared under in Ray (Ray appends ``_total`` to counters)."""
    return metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name


def ray_metric(metric: Metric) -> Any:
    """A ``ray.util.metrics`` object for a catalogue entry, its labels as tag keys."""
    from ray.util import metrics

    name, tags = ray_name(metric), tuple(metric.labels)
    if metric.kind == "counter":
        return metrics.Counter(name, metric.help, tag_keys=tags)
    if metric.kind == "gauge":
        return metrics.Gauge(name, metric.help, tag_keys=tags)
    return metrics.Histogram(name, metric.help, boundaries=list(STEP_BUCKETS), tag_keys=tags)


class RayMetrics:
    """Records what ``collector`` renders into Ray metrics at each :meth:`publish`.

    ``factory`` builds the metric object of a catalogue entry (``ray_metric``; a test passes
    its own). Not thread-safe: one thread publishes (:meth:`start`'s)."""

    def __init__(self, collector: Collector, factory: Callable[[Metric], Any] = ray_metric) -> None:
        self.collector = collector
        self.metrics = {m.name: (m, factory(m)) for m in CATALOGUE}
        # the exporter's families are named as prometheus_client names them: counters without _total
        self._by_family = {ray_name(m): m.name for m in CATALOGUE}
        self._counted: dict[tuple[str, Labels], float] = {}
        self._histograms: dict[tuple[str, Labels], tuple[list[float], float]] = {}

    def publish(self) -> None:
        """Record the collector's current rendering (see the module for how each kind is)."""
        for family in self.collector.collect():
            name = self._by_family.get(family.name)
            if name is None:
                continue
            spec, metric = self.metrics[name]
            if spec.kind == "histogram":
                self._histogram(name, metric, family.samples)
                continue
            for sample in family.samples:
                if sample.name != spec.name:  # a counter's _created, were it rendered
                    continue
                tags = dict(sample.labels)
                if spec.kind == "gauge":
                    metric.set(float(sample.value), tags)
                else:
                    self._counter(name, metric, tags, float(sample.value))

    def _counter(self, name: str, metric: Any, tags: dict[str, str], total: float) -> None:
        key = (name, tuple(sorted(tags.items())))
        before = self._counted.get(key)
        self._counted[key] = total
        grown = total if before is None or total < before else total - before
        if grown > 0:
            metric.inc(grown, tags)
        elif before is None:
            # Counter.inc refuses 0; recording 0 creates the series at 0, as the exporter has it
            metric._record(0.0, tags)

    def _histogram(self, name: str, metric: Any, samples: Iterable[Any]) -> None:
        cumulative: dict[Labels, dict[float, float]] = {}
        sums: dict[Labels, float] = {}
        for sample in samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            key = tuple(sorted(labels.items()))
            if sample.name.endswith("_bucket"):
                cumulative.setdefault(key, {})[float(sample.labels["le"])] = float(sample.value)
            elif sample.name.endswith("_sum"):
                sums[key] = float(sample.value)
        for key, by_bound in cumulative.items():
            bounds = sorted(by_bound)
            counts = [by_bound[b] - (by_bound[bounds[i - 1]] if i else 0.0) for i, b in enumerate(bounds)]
            before_counts, before_sum = self._histograms.get((name, key), ([0.0] * len(counts), 0.0))
            total = sums.get(key, 0.0)
            if sum(counts) < sum(before_counts):  # the histogram began again
                before_counts, before_sum = [0.0] * len(counts), 0.0
            self._histograms[(name, key)] = (counts, total)
            new = [round(now - was) for now, was in zip(counts, before_counts, strict=True)]
            observed = sum(new)
            if observed <= 0:
                continue
            tags = dict(key)
            filled = [i for i, n in enumerate(new) if n > 0]
            for i in filled:
                if len(filled) == 1:
                    value = (total - before_sum) / observed
                else:
                    low = bounds[i - 1] if i else 0.0
                    value = low if bounds[i] == float("inf") else (low + bounds[i]) / 2
                for _ in range(new[i]):
                    metric.observe(value, tags)

    def start(self, every_s: float = EVERY_S) -> threading.Thread:
        """Publish every ``every_s`` seconds on a daemon thread, never raising: metrics must
        not stop the steering. The collector renders under the controller's lock itself."""

        def run() -> None:
            failures = 0
            while True:
                time.sleep(every_s)
                try:
                    self.publish()
                except Exception as error:  # noqa: BLE001 - logged; the next tick tries again
                    failures += 1
                    if failures in (1, 10, 100) or failures % 1000 == 0:
                        log.error("raycomp's Ray metrics failing (%d so far): %s", failures, error)

        thread = threading.Thread(target=run, name="raycomp-ray-metrics", daemon=True)
        thread.start()
        return thread
