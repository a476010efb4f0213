"""Prometheus exporter: the controller's state, rendered at every scrape.

One HTTP endpoint serves every run (labels ``run``, ``rank``, ``layer``, ``reason``) from
the catalogue in ``raycomp._internal.observe.metrics``. Nothing is copied into client-library metric
objects: the collector reads the :class:`~raycomp.controllers.service.Controller` directly, so
finished runs disappear when the controller evicts them (after its grace period) and
counters survive a controller restart with the snapshot.

The endpoint binds to 127.0.0.1 unless configured otherwise. Its address is written as a
Prometheus file-based service-discovery target list, so Prometheus finds it without any
configuration change (``dashboards/prometheus/prometheus.yml`` watches that file).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server

from raycomp._internal.guard import REASONS
from raycomp._internal.observe.metrics import BY_NAME, CATALOGUE, SD_DIR, STEP_BUCKETS, group_layers

if TYPE_CHECKING:
    from .state import RunState


class ControllerView(Protocol):
    """What the exporter reads of the controller (``raycomp.controllers.service.Controller``, which
    builds the exporter: naming the class here would make the two modules import each other)."""

    runs: dict[str, RunState]
    rejected: Mapping[str, int]

DEFAULT_SD_FILE = f"{SD_DIR}/raycomp-controller.json"


def _family(name: str) -> Metric:
    spec = BY_NAME[name]
    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
    # counter families take the name without _total; the client library appends it
    family_name = name.removesuffix("_total") if spec.kind == "counter" else name
    return kinds[spec.kind](family_name, spec.help, labels=list(spec.labels))


class ControllerCollector:
    """Renders the controller's state at each scrape, holding ``lock`` (the lock the
    controller's writers hold) so that a scrape never sees a half-merged report."""

    def __init__(self, controller: ControllerView, lock: AbstractContextManager[Any] | None = None) -> None:
        self.controller = controller
        self.lock = lock if lock is not None else contextlib.nullcontext()

    def collect(self) -> Iterator[Metric]:
        families = {m.name: _family(m.name) for m in CATALOGUE}
        with self.lock:
            for run in list(self.controller.runs.values()):
                self._run(run, families)
            rejected = families["raycomp_controller_rejected_reports_total"]
            for reason in ("malformed", "unknown_run", "too_large"):
                rejected.add_metric([reason], self.controller.rejected.get(reason, 0))
        yield from families.values()

    def _run(self, run: RunState, f: dict[str, Any]) -> None:
        rid = run.run_id
        for rank, (wire, dense) in sorted(run.per_rank_bytes.items()):
            f["raycomp_wire_bytes_total"].add_metric([rid, str(rank)], wire)
            f["raycomp_dense_bytes_total"].add_metric([rid, str(rank)], dense)
        for rank, intra in sorted(run.per_rank_intra.items()):
            f["raycomp_intra_node_bytes_total"].add_metric([rid, str(rank)], intra)
        if run.node_link is not None:
            f["raycomp_node_link_bytes_per_second"].add_metric([rid], 1 / run.node_link)
        if run.wire_bytes > 0:
            f["raycomp_compression_ratio"].add_metric([rid], run.dense_bytes / run.wire_bytes)
        sizes = {name: h.numel for name, h in run.layers.items()}
        latest = {name: h for name, h in run.layers.items() if h.grad_norm}
        series = {
            "raycomp_layer_grad_norm": ({n: h.grad_norm[-1][1] for n, h in latest.items()}, "rss"),
            "raycomp_layer_residual_norm": ({n: h.residual_norm[-1][1] for n, h in latest.items()}, "rss"),
            "raycomp_layer_compression_error": ({n: h.compression_error[-1][1] for n, h in latest.items()}, "mean"),
            "raycomp_layer_compression_ratio": (
                {n: h.dense_bytes / h.wire_bytes for n, h in latest.items() if h.wire_bytes > 0}, "mean"),
        }
        for name, (values, combine) in series.items():
            for layer, value in group_layers(values, sizes, combine).items():
                f[name].add_metric([rid, layer], value)
        if run.losses:
            f["raycomp_loss"].add_metric([rid], run.losses[-1][1])
        if run.eval_metric is not None:
            f["raycomp_eval_metric"].add_metric([rid, run.eval_kind], run.eval_metric)
        f["raycomp_fallback_active"].add_metric([rid], float(run.fallback_active))
        f["raycomp_skipped_steps_total"].add_metric([rid], run.skipped_steps)
        if run.loss_scale is not None:
            f["raycomp_loss_scale"].add_metric([rid], run.loss_scale)
        # every known reason from the start at 0, so the first event is an increase
        reasons = {reason: 0 for reason in REASONS} | run.fallback_by_reason
        for reason, count in sorted(reasons.items()):
            f["raycomp_fallback_events_total"].add_metric([rid, reason], count)
        f["raycomp_plan_version"].add_metric([rid], run.plan.version)
        local = run.plan.local_steps
        f["raycomp_local_sync_every"].add_metric([rid], 0 if local is None else local.sync_every)
        f["raycomp_outer_steps_total"].add_metric([rid], run.outer_steps)
        if run.lr is not None:
            f["raycomp_learning_rate"].add_metric([rid], run.lr)
        # switches without a recorded rule (a run restored from an older snapshot), and a
        # series from the start at 0, so the first switch is an increase
        by_rule = dict(run.switches_by_rule)
        unattributed = run.plan_switches - sum(by_rule.values())
        if unattributed > 0 or not by_rule:
            by_rule["unattributed"] = max(0, unattributed)
        for rule, count in sorted(by_rule.items()):
            f["raycomp_plan_switches_total"].add_metric([rid, rule], count)
        f["raycomp_controller_reports_total"].add_metric([rid], run.reports)
        f["raycomp_controller_outages_total"].add_metric([rid], sum(run.per_rank_outages.values()))
        f["raycomp_run_active"].add_metric([rid], float(run.status == "running"))
        if run.timings:
            f["raycomp_samples_per_second"].add_metric([rid], run.timings[-1].samples_per_second)
        for name, histogram in run.histograms.items():
            buckets = [(str(b), c) for b, c in zip(STEP_BUCKETS, histogram.counts, strict=True)]
            buckets.append(("+Inf", histogram.count))
            f[f"raycomp_{name}"].add_metric([rid], buckets, histogram.total)


class Exporter:
    """Serves ``/metrics`` for a controller and advertises it via a file-SD target list."""

    def __init__(self, controller: ControllerView, host: str = "127.0.0.1", port: int = 9478,
                 sd_file: str | None = DEFAULT_SD_FILE, lock: AbstractContextManager[Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ControllerCollector(controller, lock))  # type: ignore[arg-type]
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            # metrics must never take the controller down: serve on a free port instead;
            # the file-SD list tells Prometheus where
            print(f"raycomp metrics: port {port} unavailable ({error}); using a free port", flush=True)
            self.server, self.thread = start_http_server(0, addr=host, registry=self.registry)
        self.host, self.port = host, self.server.server_port
        self.sd_file = Path(sd_file) if sd_file else None
        if self.sd_file:
            write_targets(self.sd_file, [f"{self._advertised_host()}:{self.port}"])
        print(f"raycomp metrics: http://{self.host}:{self.port}/metrics"
              + (f" (Prometheus file-SD targets: {self.sd_file})" if self.sd_file else ""), flush=True)

    def _advertised_host(self) -> str:
        return socket.gethostbyname(socket.gethostname()) if self.host in ("0.0.0.0", "") else self.host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def write_targets(path: Path, targets: list[str]) -> None:
    """A Prometheus file_sd target list, written atomically (Prometheus watches the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"targets": targets, "labels": {"job": "raycomp"}}]))
    os.replace(tmp, path)


def port_holder(host: str, port: int) -> str | None:
    """None if ``port`` is free (or serves raycomp metrics already), else what holds it."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return None
        except OSError:
            pass
    try:
        import urllib.request

        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as answer:
            if b"raycomp_" in answer.read(1 << 20):
                return None  # our own controller's exporter: it is shared by every run
    except OSError:
        pass
    return "another program"
