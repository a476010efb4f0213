"""raycomp's metrics through Ray's metrics API (``raycomp.controllers.ray_metrics``): every
series the standalone exporter renders for a controller is recorded into Ray with the same
labels and value, first against recording fakes (counter deltas, histogram buckets), then
end to end: the controller actor on a real Ray cluster, its series read back from the
node's metrics agent (``http://127.0.0.1:<metrics export port>/metrics``) as ``ray_raycomp_...``."""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from raycomp._internal.observe.metrics import CATALOGUE, STEP_BUCKETS, Metric
from raycomp.controllers.exporter import ControllerCollector
from raycomp.controllers.policies import StaticOptions
from raycomp.controllers.ray_metrics import RayMetrics, ray_name
from raycomp.controllers.service import Controller
from tests.support.controller_reports import LAYERS, register, report

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
LABELS = {label for m in CATALOGUE for label in m.labels} | {"le"}


def _series(text: str, prefix: str = "", keep: dict[str, str] | None = None) -> Series:
    """The samples of a Prometheus text page as {(name without ``prefix``, catalogue labels): value};
    only names that start with ``prefix`` + ``raycomp_`` and, with ``keep``, samples whose
    labels include those. ``le`` is normalised to a float's repr (Ray writes 10.0 as "10.0",
    prometheus_client as "10.0" too, but 0.005 either way)."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix + "raycomp_") or sample.name.endswith("_created"):
                continue
            if keep and any(sample.labels.get(k) != v for k, v in keep.items()):
                continue
            labels = {k: (repr(float(v)) if k == "le" else v) for k, v in sample.labels.items() if k in LABELS}
            out[(sample.name.removeprefix(prefix), tuple(sorted(labels.items())))] = float(sample.value)
    return out


def exported(controller: Controller) -> Series:
    """What the standalone exporter serves for ``controller``, parsed."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ControllerCollector(controller))  # type: ignore[arg-type]
    return _series(generate_latest(registry).decode())


def fed(controller: Controller, run_id: str, steps=(4, 9)) -> Controller:
    """A run's reports for ``steps`` from both ranks, a rejected one and an NaN loss: the
    static policy switches at the end of warm-up, so the plan version is 1."""
    for step in steps:
        for rank in (0, 1):
            controller.ingest(report(run_id, rank, step, step_seconds=0.1 * (step + 1)))
    controller.ingest(report("no-such-run", 0, 4))
    return controller


class Fake:
    """A recording stand-in for a ``ray.util.metrics`` object, rendered as Prometheus would."""

    def __init__(self, spec: Metric) -> None:
        self.spec = spec
        self.values: dict[tuple, float] = {}
        self.observed: dict[tuple, list[float]] = defaultdict(list)

    def set(self, value, tags):
        self.values[tuple(sorted(tags.items()))] = value

    def inc(self, value, tags):
        assert value > 0  # as Ray's Counter.inc demands
        key = tuple(sorted(tags.items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def _record(self, value, tags):
        key = tuple(sorted(tags.items()))
        self.values[key] = self.values.get(key, 0.0) + value

    def observe(self, value, tags):
        self.observed[tuple(sorted(tags.items()))].append(value)

    def series(self) -> Series:
        name = self.spec.name
        if self.spec.kind != "histogram":
            return {(name, key): value for key, value in self.values.items()}
        out: Series = {}
        for key, values in self.observed.items():
            for bound in (*STEP_BUCKETS, float("inf")):
                le = tuple(sorted((*key, ("le", repr(bound)))))
                out[(f"{name}_bucket", le)] = float(sum(v <= bound for v in values))
            out[(f"{name}_count", key)] = float(len(values))
            out[(f"{name}_sum", key)] = sum(values)
        return out


def _fakes() -> tuple[RayMetrics, dict[str, Fake]]:
    fakes: dict[str, Fake] = {}

    def factory(spec: Metric) -> Fake:
        fakes[spec.name] = Fake(spec)
        return fakes[spec.name]

    controller = Controller()
    register(controller, "r1", warmup=10)
    return RayMetrics(ControllerCollector(controller), factory), fakes


def _recorded(fakes: dict[str, Fake]) -> Series:
    return {k: v for fake in fakes.values() for k, v in fake.series().items()}


def _stale(key) -> bool:
    """A series the exporter renders only until it has a real one beside it: the run's plan
    switches without a rule, at 0 before the first switch. Recorded into Ray, it stays."""
    return key[0] == "raycomp_plan_switches_total" and dict(key[1]).get("rule") == "unattributed"


def _bucket_bounds(want: Series, key) -> tuple[float, float]:
    """The least and the most a histogram's sum can be, given its bucket counts in ``want``."""
    name, labels = key[0].removesuffix("_sum"), key[1]
    cumulative = sorted((float(dict(k)["le"]), v) for (n, k), v in want.items()
                        if n == f"{name}_bucket" and tuple(p for p in k if p[0] != "le") == labels)
    low = high = 0.0
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in cumulative:
        if count > previous_count:
            low += (count - previous_count) * previous_bound
            high += (count - previous_count) * bound
        previous_bound, previous_count = bound, count
    return low, high


def _wrong(got: Series, want: Series, sums_by_bucket: bool) -> dict:
    """Series whose value differs. With ``sums_by_bucket`` a histogram's sum need only lie
    within its buckets: Ray's agent (2.60) rebuilds a worker's histogram from its bucket
    counts at the buckets' midpoints, so the sum it serves is not the observed one."""
    wrong = {}
    for key, value in want.items():
        if sums_by_bucket and key[0].endswith("_seconds_sum"):
            low, high = _bucket_bounds(want, key)
            if not low <= got[key] <= high:
                wrong[key] = (got[key], (low, high))
        elif got[key] != pytest.approx(value, rel=1e-9):
            wrong[key] = (got[key], value)
    return wrong


def _same(got: Series, want: Series, sums_by_bucket: bool = False) -> bool:
    return set(want) <= set(got) and all(_stale(k) and got[k] == 0 for k in set(got) - set(want)) \
        and not _wrong(got, want, sums_by_bucket)


def _assert_same(got: Series, want: Series, sums_by_bucket: bool = False) -> None:
    extra = {k: got[k] for k in set(got) - set(want) if not (_stale(k) and got[k] == 0)}
    assert set(want) <= set(got) and not extra, (sorted(set(want) - set(got)), extra)
    wrong = _wrong(got, want, sums_by_bucket)
    assert not wrong, wrong


def test_every_exported_series_is_recorded_with_its_value_and_counters_grow_by_their_increase():
    published, fakes = _fakes()
    controller = published.collector.controller
    published.publish()  # before any report: counters at 0 exist (their first event is an increase)
    assert fakes["raycomp_fallback_events_total"].values[(("reason", "loss_spike"), ("run", "r1"))] == 0.0
    fed(controller, "r1", steps=(4,))
    published.publish()
    _assert_same(_recorded(fakes), exported(controller))
    fed(controller, "r1", steps=(9, 14))  # the plan switches; every total grows
    published.publish()
    published.publish()  # nothing new: nothing recorded twice
    want = exported(controller)
    assert want[("raycomp_plan_version", (("run", "r1"),))] == 1.0
    assert want[("raycomp_controller_rejected_reports_total", (("reason", "unknown_run"),))] == 2.0  # one per fed()
    _assert_same(_recorded(fakes), want)


def test_a_histogram_spread_over_buckets_keeps_exact_counts():
    published, fakes = _fakes()
    controller = published.collector.controller
    fed(controller, "r1", steps=(0, 4, 9, 49))  # step times 0.1 ... 5.0 s in one tick
    published.publish()
    got, want = _recorded(fakes), exported(controller)
    for key, value in want.items():
        if key[0].startswith("raycomp_step_seconds_") and not key[0].endswith("_sum"):
            assert got[key] == value, key
    total = want[("raycomp_step_seconds_sum", (("run", "r1"),))]
    assert got[("raycomp_step_seconds_sum", (("run", "r1"),))] == pytest.approx(total, rel=0.5)


def test_ray_names_are_the_catalogue_s_once_ray_adds_its_prefix_and_suffix():
    for metric in CATALOGUE:
        exported_as = "ray_" + ray_name(metric) + ("_total" if metric.kind == "counter" else "")
        assert exported_as == "ray_" + metric.name


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return answer.read().decode()
    except OSError:
        return ""


def test_the_controller_actor_s_metrics_reach_ray_s_prometheus_endpoint(ray_cluster, tmp_path):
    """The controller actor on a real cluster: Ray's metrics agent serves every series the
    standalone exporter would, as ``ray_`` + its name, with the same labels and values."""
    import ray

    from raycomp.controllers.service import get_or_create

    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    assert port > 0, "the node has no metrics export port"
    name = f"ctl-raymetrics-{tmp_path.name}"[:60]
    actor = get_or_create(name, "raycomp-tests", None, max_restarts=0, ray_metrics_every_s=0.5)
    try:
        worker = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_worker_id()))
        run_id = f"rm-{tmp_path.name}"
        ray.get(actor.register_run.remote(run_id, 2, LAYERS, "static", StaticOptions().model_dump(mode="json"),
                                          10, 5, 1024))  # as register() does
        local = Controller()
        register(local, run_id, warmup=10)
        for step in (4, 9):
            for rank in (0, 1):
                assert ray.get(actor.ingest.remote(report(run_id, rank, step, step_seconds=0.1 * (step + 1))))
        assert not ray.get(actor.ingest.remote(report("no-such-run", 0, 4)))
        want = exported(fed(local, run_id))
        assert want[("raycomp_plan_version", (("run", run_id),))] == 1.0
        deadline, got = time.monotonic() + 120, {}
        while time.monotonic() < deadline:  # Ray's agent exports every few seconds
            got = _series(_scrape(port), prefix="ray_", keep={"WorkerId": worker})
            if _same(got, want, sums_by_bucket=True):
                break
            time.sleep(0.5)
        _assert_same(got, want, sums_by_bucket=True)
    finally:
        ray.kill(actor)
