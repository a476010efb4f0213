"""The Prometheus metric catalogue: the single source for the exporter and the dashboard.

Every metric raycomp exports is declared here once — name, type, help, labels — together
with the dashboard panel that shows it. ``controllers/exporter.py`` serves exactly these
metrics, ``controllers/ray_metrics.py`` records the same series into Ray's metrics API
(served by Ray's agents as ``ray_`` + the name) and ``raycomp/_internal/observe/dashboard.py`` generates the
Grafana dashboard and Prometheus files from them; tests check that the three agree with
each other, with a real Ray cluster's metrics endpoint and with a real Prometheus.

Conventions: ``raycomp_`` prefix, base units (bytes, seconds), ``_total`` counters,
``_seconds`` histograms. Labels are bounded: ``run`` and ``rank`` by the cluster,
``layer`` by :data:`MAX_LAYER_LABELS` (the rest is grouped as ``(other)``), ``reason`` by
a fixed set.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BY_NAME", "CATALOGUE", "MAX_LAYER_LABELS", "Metric", "OTHER_LAYERS", "Panel", "ROWS", "SD_DIR",
    "STEP_BUCKETS", "group_layers", "series_names"
]

#: where controllers write their file-SD target lists; dashboards/prometheus/prometheus.yml
#: watches ``*.json`` here (here, not in controllers/: the driver's preflight checks the path)
SD_DIR = "/tmp/raycomp/prometheus"
MAX_LAYER_LABELS = 24
OTHER_LAYERS = "(other)"
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

ROWS = ("Compression", "Convergence", "Controller decisions", "Throughput")


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    expr: str  # PromQL; $run is the dashboard's run variable
    unit: str = "short"  # Grafana unit
    legend: str = "{{run}}"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...]
    panels: tuple[Panel, ...]


def _sel(extra: str = "") -> str:
    return '{run=~"$run"' + (f",{extra}" if extra else "") + "}"


CATALOGUE: tuple[Metric, ...] = (
    Metric("raycomp_wire_bytes_total", "counter",
           "Bytes this rank transmitted for gradients (collective model, see raycomp._internal.transports)",
           ("run", "rank"),
           (Panel("Compression", "Wire bytes per second (across nodes, with two levels)", f"sum by (run) (rate(raycomp_wire_bytes_total{_sel()}[1m]))", "Bps"),
            Panel("Compression", "Wire bytes (total)", f"sum by (run) (raycomp_wire_bytes_total{_sel()})", "bytes"))),
    Metric("raycomp_intra_node_bytes_total", "counter",
           "Bytes this rank transmitted inside its node (two levels, raycomp._internal.reduce.two_level: the node's exchange "
           "and all-gather; raycomp_wire_bytes_total then counts what crossed nodes); 0 when flat",
           ("run", "rank"),
           (Panel("Compression", "Bytes per second inside nodes (two levels)",
                  f"sum by (run) (rate(raycomp_intra_node_bytes_total{_sel()}[1m]))", "Bps"),)),
    Metric("raycomp_node_link_bytes_per_second", "gauge",
           "Bytes per second a rank sends in an all-reduce inside its node, timed as the run started "
           "(two levels, raycomp._internal.node_link): the link the controller prices a node's own hops at; the link "
           "across nodes is measured from the steps (raycomp_wire_bytes_total over raycomp_comm_seconds)",
           ("run",),
           (Panel("Compression", "Link inside nodes (two levels, timed at the start)",
                  f"raycomp_node_link_bytes_per_second{_sel()}", "Bps"),)),
    Metric("raycomp_dense_bytes_total", "counter",
           "Bytes the same gradients would have needed with dense all-reduce",
           ("run", "rank"),
           (Panel("Compression", "Bytes saved", f"sum by (run) (raycomp_dense_bytes_total{_sel()}) - sum by (run) (raycomp_wire_bytes_total{_sel()})", "bytes"),)),
    Metric("raycomp_compression_ratio", "gauge",
           "Dense-equivalent bytes / wire bytes over the whole run so far", ("run",),
           (Panel("Compression", "Compression ratio (run)", f"raycomp_compression_ratio{_sel()}"),)),
    Metric("raycomp_layer_compression_ratio", "gauge",
           "Dense / wire bytes of one layer at the latest statistics step", ("run", "layer"),
           (Panel("Compression", "Compression ratio per layer", f"raycomp_layer_compression_ratio{_sel()}", legend="{{layer}}"),)),
    Metric("raycomp_layer_compression_error", "gauge",
           "Relative compression error ||c - sent|| / ||c|| of a layer (mean over ranks)", ("run", "layer"),
           (Panel("Compression", "Relative compression error per layer", f"raycomp_layer_compression_error{_sel()}", "percentunit", "{{layer}}"),)),
    Metric("raycomp_layer_grad_norm", "gauge",
           "Gradient L2 norm of a layer (mean over ranks)", ("run", "layer"),
           (Panel("Convergence", "Gradient norm per layer", f"raycomp_layer_grad_norm{_sel()}", legend="{{layer}}"),)),
    Metric("raycomp_layer_residual_norm", "gauge",
           "Error-feedback residual L2 norm of a layer (mean over ranks)", ("run", "layer"),
           (Panel("Convergence", "Error-feedback residual norm per layer", f"raycomp_layer_residual_norm{_sel()}", legend="{{layer}}"),)),
    Metric("raycomp_loss", "gauge", "Training loss (mean over ranks, latest interval)", ("run",),
           (Panel("Convergence", "Training loss", f"raycomp_loss{_sel()}"),)),
    Metric("raycomp_eval_metric", "gauge",
           "Latest evaluation result: test accuracy (classification) or test loss (language model)",
           ("run", "metric"),
           (Panel("Convergence", "Eval accuracy / loss", f"raycomp_eval_metric{_sel()}", legend="{{run}} {{metric}}"),)),
    Metric("raycomp_fallback_active", "gauge", "1 while the guard has every rank on dense all-reduce", ("run",),
           (Panel("Controller decisions", "Dense fallback active", f"raycomp_fallback_active{_sel()}"),)),
    Metric("raycomp_skipped_steps_total", "counter",
           "Optimizer steps skipped: by the guard (non-finite or exploding gradients) or for a loss-scale overflow",
           ("run",),
           (Panel("Controller decisions", "Skipped steps", f"raycomp_skipped_steps_total{_sel()}"),)),
    Metric("raycomp_loss_scale", "gauge", "The GradScaler's loss scale (fp16 runs only)", ("run",),
           (Panel("Convergence", "Loss scale (fp16)", f"raycomp_loss_scale{_sel()}"),)),
    Metric("raycomp_fallback_events_total", "counter", "Switches to dense fallback, by reason", ("run", "reason"),
           (Panel("Controller decisions", "Fallback events by reason", f"sum by (run, reason) (raycomp_fallback_events_total{_sel()})", legend="{{run}} {{reason}}"),)),
    Metric("raycomp_plan_version", "gauge", "Version of the plan the controller publishes", ("run",),
           (Panel("Controller decisions", "Plan version", f"raycomp_plan_version{_sel()}"),)),
    Metric("raycomp_local_sync_every", "gauge",
           "Local steps in the plan: inner steps between syncs (H); 0 while gradients are reduced every step",
           ("run",),
           (Panel("Controller decisions", "Local steps: sync every H steps (0: per step)", f"raycomp_local_sync_every{_sel()}"),)),
    Metric("raycomp_learning_rate", "gauge",
           "The optimizer's learning rate the ranks reported (its largest group's); under local steps' auto "
           "mode the largest H grows with the square of its decay from its peak",
           ("run",),
           (Panel("Controller decisions", "Learning rate (auto: largest H x (peak / lr)^2)", f"raycomp_learning_rate{_sel()}"),)),
    Metric("raycomp_outer_steps_total", "counter",
           "Outer steps of local steps: syncs that averaged the pseudo-gradients and moved the global weights",
           ("run",),
           (Panel("Controller decisions", "Outer steps (local-step syncs) per minute",
                  f"rate(raycomp_outer_steps_total{_sel()}[1m]) * 60"),)),
    Metric("raycomp_plan_switches_total", "counter",
           "Plans published after the first, by the policy rule that decided them", ("run", "rule"),
           (Panel("Controller decisions", "Plan switches by rule",
                  f"sum by (run, rule) (raycomp_plan_switches_total{_sel()})", legend="{{run}} {{rule}}"),)),
    Metric("raycomp_controller_reports_total", "counter", "Statistics reports accepted from workers", ("run",),
           (Panel("Controller decisions", "Reports received per second", f"rate(raycomp_controller_reports_total{_sel()}[1m])", "reqps"),)),
    Metric("raycomp_controller_rejected_reports_total", "counter",
           "Reports rejected (malformed, unknown run, too large)", ("reason",),
           (Panel("Controller decisions", "Rejected reports", "sum by (reason) (raycomp_controller_rejected_reports_total)", legend="{{reason}}"),)),
    Metric("raycomp_controller_outages_total", "counter",
           "Times workers could not reach the controller (they kept training on the last plan)", ("run",),
           (Panel("Controller decisions", "Controller outages seen by workers", f"raycomp_controller_outages_total{_sel()}"),)),
    Metric("raycomp_run_active", "gauge", "1 while the run is training, 0 once finished", ("run",),
           (Panel("Throughput", "Active runs", f"raycomp_run_active{_sel()}"),)),
    Metric("raycomp_step_seconds", "histogram", "Training step time (interval means, per rank)", ("run",),
           (Panel("Throughput", "Step time p50 / p99",
                  f"histogram_quantile(0.5, sum by (run, le) (rate(raycomp_step_seconds_bucket{_sel()}[2m])))", "s"),)),
    Metric("raycomp_compute_seconds", "histogram", "Compute part of a step (step minus communication)", ("run",),
           (Panel("Throughput", "Compute vs communication per step",
                  f"sum by (run) (rate(raycomp_compute_seconds_sum{_sel()}[2m])) / sum by (run) (rate(raycomp_compute_seconds_count{_sel()}[2m]))", "s"),)),
    Metric("raycomp_comm_seconds", "histogram", "Time a step waited for its gradient reductions (not what overlapped backward)", ("run",),
           (Panel("Throughput", "Communication time per step",
                  f"sum by (run) (rate(raycomp_comm_seconds_sum{_sel()}[2m])) / sum by (run) (rate(raycomp_comm_seconds_count{_sel()}[2m]))", "s"),)),
    Metric("raycomp_samples_per_second", "gauge", "Training throughput over all ranks", ("run",),
           (Panel("Throughput", "Samples per second", f"raycomp_samples_per_second{_sel()}"),)),
)

BY_NAME = {m.name: m for m in CATALOGUE}


def series_names(metric: Metric) -> tuple[str, ...]:
    """The names Prometheus stores for a metric (histograms have three)."""
    if metric.kind == "histogram":
        return (f"{metric.name}_bucket", f"{metric.name}_sum", f"{metric.name}_count")
    return (metric.name,)


def group_layers(values: dict[str, float], sizes: dict[str, int], combine: str) -> dict[str, float]:
    """Bound the ``layer`` label: the largest layers by size keep their name, the rest are
    combined into :data:`OTHER_LAYERS` (``"rss"``: root of sum of squares, for norms;
    ``"mean"``: size-weighted mean, for relative errors and ratios)."""
    if len(values) <= MAX_LAYER_LABELS:
        return dict(values)
    ranked = sorted(values, key=lambda name: (-sizes.get(name, 0), name))
    kept, rest = ranked[: MAX_LAYER_LABELS - 1], ranked[MAX_LAYER_LABELS - 1:]
    out = {name: values[name] for name in kept}
    if combine == "rss":
        out[OTHER_LAYERS] = sum(values[n] ** 2 for n in rest) ** 0.5
    else:
        weight = sum(sizes.get(n, 1) for n in rest)
        out[OTHER_LAYERS] = sum(values[n] * sizes.get(n, 1) for n in rest) / weight
    return out
