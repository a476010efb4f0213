"""What the controller knows about one run, aggregated over ranks, with bounded memory.

Reports of one boundary step are merged once every rank has sent its own (or when a
newer step completes first: a lost report never blocks decisions). Histories are
bounded deques, so a run of any length uses constant memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from raycomp._internal.observe.metrics import STEP_BUCKETS
from raycomp.messages import GradStats
from raycomp.plan import Plan

HISTORY = 256  # boundary steps kept per series
PENDING_STEPS = 8  # incomplete boundary steps kept while waiting for slow ranks
MAX_EVENTS = 1000


@dataclass
class LayerHistory:
    numel: int
    grad_norm: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    compression_error: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    residual_norm: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    compressor: str = "none"
    #: Top-K relative error at candidate ratios (``str(ratio)`` -> error), latest step
    topk_errors: dict[str, float] = field(default_factory=dict)
    wire_bytes: float = 0.0
    dense_bytes: float = 0.0
    #: the parameter's shape when the run registered it (None: only the element count is
    #: known); the adaptive policy sizes PowerSGD's factors from it
    shape: tuple[int, ...] | None = None


def layer_size(name: str, size: Any) -> tuple[int, tuple[int, ...] | None]:
    """``(numel, shape)`` from a registered layer size: an element count or a shape."""
    if isinstance(size, bool):
        raise ValueError(f"layers[{name!r}]: expected an element count or a shape, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"layers[{name!r}]: element count must be >= 0, got {size}")
        return size, None
    if isinstance(size, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in size):
        numel = 1
        for d in size:
            numel *= d
        return numel, tuple(size)
    raise ValueError(f"layers[{name!r}]: expected an element count or a shape, got {size!r}")


@dataclass
class Timing:
    step: int
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    samples_per_second: float
    wire_bytes: float  # all ranks, running total
    dense_bytes: float
    world_size: int = 0  # the ranks that reported it (0: a snapshot from before it was kept)


@dataclass
class Histogram:
    """Cumulative counts over :data:`STEP_BUCKETS` (Prometheus semantics), bounded size."""

    counts: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(STEP_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


TIMED = ("step_seconds", "compute_seconds", "comm_seconds")


class RunState:
    def __init__(self, run_id: str, world_size: int, layers: dict[str, Any], policy: str,
                 options: dict[str, Any], warmup_steps: int = 0, interval_steps: int = 1,
                 eval_kind: str = "accuracy") -> None:
        self.run_id = run_id
        self.world_size = world_size
        #: ranks per node of a two-level run (raycomp._internal.reduce.two_level), 1 when every rank is its own node
        self.per_node = 1
        #: seconds per byte of an all-reduce inside a node, timed as the run started
        #: (raycomp._internal.node_link); None: not timed, or flat
        self.node_link: float | None = None
        self.policy = policy
        self.options = options
        self.warmup_steps = warmup_steps
        self.interval_steps = interval_steps
        # layers: name -> element count, or name -> shape (list of ints)
        self.layers = {}
        for name, size in layers.items():
            numel, shape = layer_size(name, size)
            self.layers[name] = LayerHistory(numel, shape=shape)
        self.step = -1  # latest merged boundary step
        self.epoch = 0
        self.losses: deque[tuple[int, float]] = deque(maxlen=HISTORY)
        self.timings: deque[Timing] = deque(maxlen=HISTORY)
        self.eval_metric: float | None = None
        self.fallback_active = False
        self.plan = Plan(reason="warm-up: dense")
        self.plan_switches = 0
        self.switches_by_rule: dict[str, int] = {}  # plan switches by the rule that decided them
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.fallback_events = 0
        self.reports = 0
        self.finished: float | None = None  # wall time when the run finished
        self.status = "running"
        self.per_rank_bytes: dict[int, tuple[float, float]] = {}
        #: rank -> bytes it sent inside its node (two levels; per_rank_bytes: across nodes)
        self.per_rank_intra: dict[int, float] = {}
        self.per_rank_outages: dict[int, int] = {}
        self.skipped_steps = 0  # the optimizer steps skipped (the same on every rank)
        self.outer_steps = 0  # outer steps of local steps applied (the same on every rank)
        self.loss_scale: float | None = None  # the latest GradScaler scale reported (fp16 runs)
        self.lr: float | None = None  # the latest learning rate reported (None: not reported)
        self.peak_lr: float | None = None  # the largest learning rate reported so far
        self.eval_kind = eval_kind
        self.fallback_by_reason: dict[str, int] = {}
        self.histograms = {name: Histogram() for name in TIMED}
        self._pending: dict[int, dict[int, GradStats]] = {}
        self._totals_step: dict[int, int] = {}  # rank -> step of its per_rank_bytes
        self._step_evals: dict[int, float] = {}  # rank -> its evaluation at the latest merged step

    # --- ingest ---------------------------------------------------------------------
    def add(self, stats: GradStats) -> bool:
        """Keep a report; returns True when a boundary step became complete and merged."""
        if stats.rank >= self.world_size:
            raise ValueError(f"stats.rank: {stats.rank} >= world size {self.world_size}")
        self.reports += 1
        # a rank's second report of a step: the run ended on a boundary and evaluated after it
        # (the worker sends that interval again, with the evaluation)
        repeat = stats.step == self._totals_step.get(stats.rank, -1)
        # byte counts are running totals: keep the latest step's, since the controller may
        # take a rank's reports out of order (Prometheus reads them as counters)
        if stats.step >= self._totals_step.get(stats.rank, -1):
            self._totals_step[stats.rank] = stats.step
            self.per_rank_bytes[stats.rank] = (stats.wire_bytes, stats.dense_bytes)
            self.per_rank_intra[stats.rank] = stats.intra_bytes
        self.per_rank_outages[stats.rank] = max(stats.outages, self.per_rank_outages.get(stats.rank, 0))
        self.skipped_steps = max(self.skipped_steps, stats.skipped_steps)
        self.outer_steps = max(self.outer_steps, stats.outer_steps)
        if stats.loss_scale is not None and stats.step >= self._totals_step.get(stats.rank, -1):
            self.loss_scale = stats.loss_scale
        if stats.lr is not None and stats.step >= self._totals_step.get(stats.rank, -1):
            self.lr = stats.lr
            self.peak_lr = stats.lr if self.peak_lr is None else max(self.peak_lr, stats.lr)
        if not repeat:  # the same interval again adds no timing sample
            for name in TIMED:
                self.histograms[name].observe(getattr(stats, name))
        for event in stats.events:
            if stats.rank == 0:  # the guard is identical on every rank: count it once
                self.events.append({**event, "rank": stats.rank})
                if event.get("kind") == "fallback":
                    self.fallback_events += 1
                    reason = str(event.get("reason", "unknown"))[:64]
                    self.fallback_by_reason[reason] = self.fallback_by_reason.get(reason, 0) + 1
        if stats.step <= self.step:
            if stats.step == self.step and stats.eval_metric is not None:
                # an evaluation sent after its step merged (the run ended on a boundary and
                # evaluated after it): the mean over the ranks that sent one
                self._step_evals[stats.rank] = stats.eval_metric
                self.eval_metric = _mean(list(self._step_evals.values()))
            return False  # late report of an already merged step
        pending = self._pending.setdefault(stats.step, {})
        if stats.rank in pending and stats.eval_metric is None:  # a repeat arrived first: keep its evaluation
            stats = replace(stats, eval_metric=pending[stats.rank].eval_metric)
        pending[stats.rank] = stats
        if len(pending) < self.world_size:
            if len(self._pending) > PENDING_STEPS:  # a rank went quiet: merge what we have
                oldest = min(self._pending)
                self._merge(oldest, self._pending.pop(oldest))
                return True
            return False
        self._merge(stats.step, self._pending.pop(stats.step))
        for older in [s for s in self._pending if s < stats.step]:
            del self._pending[older]
        return True

    def _merge(self, step: int, reports: dict[int, GradStats]) -> None:
        all_reports = list(reports.values())
        self.step = step
        self.epoch = max(r.epoch for r in all_reports)
        self.losses.append((step, _mean([r.loss for r in all_reports])))
        self.fallback_active = any(r.fallback_active for r in all_reports)
        self._step_evals = {r.rank: r.eval_metric for r in all_reports if r.eval_metric is not None}
        if self._step_evals:
            self.eval_metric = _mean(list(self._step_evals.values()))
        wire = sum(w for w, _ in self.per_rank_bytes.values())
        dense = sum(d for _, d in self.per_rank_bytes.values())
        self.timings.append(Timing(
            step,
            _mean([r.step_seconds for r in all_reports]),
            _mean([r.compute_seconds for r in all_reports]),
            _mean([r.comm_seconds for r in all_reports]),
            sum(r.samples_per_second for r in all_reports),
            wire, dense, self.world_size,
        ))
        by_layer: dict[str, list[dict[str, Any]]] = {}
        for report in all_reports:
            for layer in report.layers:
                by_layer.setdefault(layer["layer"], []).append(layer)
        for name, entries in by_layer.items():
            history = self.layers.get(name)
            if history is None:
                continue  # a layer the run did not register: ignore, never grow unbounded
            history.grad_norm.append((step, _mean([e["grad_norm"] for e in entries])))
            history.compression_error.append((step, _mean([e["compression_error"] for e in entries])))
            history.residual_norm.append((step, _mean([e["residual_norm"] for e in entries])))
            history.compressor = entries[0].get("compressor", history.compressor)
            history.wire_bytes = sum(e["wire_bytes"] for e in entries)
            history.dense_bytes = sum(e["dense_bytes"] for e in entries)
            profiles = [e.get("topk_errors") or {} for e in entries]
            keys = set.intersection(*(set(p) for p in profiles)) if profiles else set()
            history.topk_errors = {k: _mean([p[k] for p in profiles]) for k in sorted(keys)}

    def resize(self, world_size: int) -> None:
        """The run restarted on ``world_size`` workers (an elastic resize): reports are
        expected from that many ranks. Byte totals come back from every new rank (the
        workers fold the old ranks' totals into the new ones), so the old ranks' latest
        totals are forgotten, as are steps half-reported by the old group."""
        before, self.world_size = self.world_size, world_size
        self._pending.clear()
        self.per_rank_bytes.clear()
        self.per_rank_intra.clear()
        self._totals_step.clear()
        self._step_evals.clear()
        self.per_rank_outages = {r: n for r, n in self.per_rank_outages.items() if r < world_size}
        self.events.append({"step": self.step, "kind": "resize", "reason": "elastic restart",
                            "detail": f"{before} -> {world_size} workers"})

    # --- views for policies -------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """The run's nodes: W / per_node in two levels, else W (every rank its own node).
        A two-level run's compressed collectives span them, and local steps' replicas are
        them."""
        return max(1, self.world_size // max(1, self.per_node))

    @property
    def wire_bytes(self) -> float:
        return sum(w for w, _ in self.per_rank_bytes.values())

    @property
    def dense_bytes(self) -> float:
        return sum(d for _, d in self.per_rank_bytes.values())

    def install(self, plan: Plan, why: dict[str, Any] | None = None) -> Plan:
        """Publish ``plan`` (next version) if it differs from the current one; ``why``: the
        decision's facts (:meth:`raycomp.controllers.policies.decision.Decision.facts`), kept with the
        plan event and counted by their rule."""
        same = (plan.default, plan.layers, plan.dense, plan.local) == \
            (self.plan.default, self.plan.layers, self.plan.dense, self.plan.local)
        if same:
            return self.plan
        self.plan = plan.with_version(self.plan.version + 1)
        self.plan_switches += 1
        event = {"step": self.step, "kind": "plan", "reason": plan.reason, "detail": f"version {self.plan.version}"}
        if why is not None:
            rule = str(why.get("rule", "unknown"))
            self.switches_by_rule[rule] = self.switches_by_rule.get(rule, 0) + 1
            event["why"] = why
        self.events.append(event)
        return self.plan

    # --- snapshots ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "world_size": self.world_size, "per_node": self.per_node,
            "node_link": self.node_link, "policy": self.policy,
            "options": self.options, "warmup_steps": self.warmup_steps,
            "interval_steps": self.interval_steps, "step": self.step, "epoch": self.epoch,
            "layers": {
                name: {
                    "numel": h.numel, "shape": None if h.shape is None else list(h.shape),
                    "grad_norm": list(h.grad_norm),
                    "compression_error": list(h.compression_error),
                    "residual_norm": list(h.residual_norm), "compressor": h.compressor,
                    "topk_errors": h.topk_errors, "wire_bytes": h.wire_bytes, "dense_bytes": h.dense_bytes,
                }
                for name, h in self.layers.items()
            },
            "losses": list(self.losses), "timings": [vars(t) for t in self.timings],
            "eval_metric": self.eval_metric, "fallback_active": self.fallback_active,
            "plan": self.plan.to_dict(), "plan_switches": self.plan_switches,
            "events": list(self.events), "fallback_events": self.fallback_events,
            "reports": self.reports, "status": self.status,
            "per_rank_bytes": {str(k): list(v) for k, v in self.per_rank_bytes.items()},
            "per_rank_intra": {str(k): v for k, v in self.per_rank_intra.items()},
            "per_rank_outages": {str(k): v for k, v in self.per_rank_outages.items()},
            "skipped_steps": self.skipped_steps, "loss_scale": self.loss_scale, "outer_steps": self.outer_steps,
            "lr": self.lr, "peak_lr": self.peak_lr,
            "eval_kind": self.eval_kind, "fallback_by_reason": self.fallback_by_reason,
            "switches_by_rule": self.switches_by_rule,
            "histograms": {k: vars(h) for k, h in self.histograms.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        sizes = {n: v["shape"] if v.get("shape") is not None else v["numel"] for n, v in data["layers"].items()}
        run = cls(data["run_id"], data["world_size"], sizes,
                  data["policy"], data["options"], data["warmup_steps"], data["interval_steps"],
                  data["eval_kind"])
        run.step, run.epoch = data["step"], data["epoch"]
        run.per_node = int(data.get("per_node", 1))
        run.node_link = data.get("node_link")
        for name, v in data["layers"].items():
            h = run.layers[name]
            h.grad_norm.extend(tuple(x) for x in v["grad_norm"])
            h.compression_error.extend(tuple(x) for x in v["compression_error"])
            h.residual_norm.extend(tuple(x) for x in v["residual_norm"])
            h.compressor, h.topk_errors = v["compressor"], v["topk_errors"]
            h.wire_bytes, h.dense_bytes = v["wire_bytes"], v["dense_bytes"]
        run.losses.extend(tuple(x) for x in data["losses"])
        run.timings.extend(Timing(**t) for t in data["timings"])
        run.eval_metric, run.fallback_active = data["eval_metric"], data["fallback_active"]
        run.plan = Plan.from_dict(data["plan"])
        run.plan_switches, run.fallback_events = data["plan_switches"], data["fallback_events"]
        run.switches_by_rule = dict(data.get("switches_by_rule", {}))
        run.events.extend(data["events"])
        run.reports, run.status = data["reports"], data["status"]
        run.per_rank_bytes = {int(k): (v[0], v[1]) for k, v in data["per_rank_bytes"].items()}
        run.per_rank_intra = {int(k): v for k, v in data.get("per_rank_intra", {}).items()}
        run.per_rank_outages = {int(k): v for k, v in data["per_rank_outages"].items()}
        run.skipped_steps, run.loss_scale = data.get("skipped_steps", 0), data.get("loss_scale")
        run.outer_steps = data.get("outer_steps", 0)
        run.lr, run.peak_lr = data.get("lr"), data.get("peak_lr")
        run.fallback_by_reason = dict(data["fallback_by_reason"])
        run.histograms = {k: Histogram(**h) for k, h in data["histograms"].items()}
        return run


def _mean(values: list[float]) -> float:
    # plain sum, not statistics.fmean: this runs for every statistic of every merged report,
    # and fsum's extra precision is irrelevant for a handful of statistics
    return sum(values) / len(values)
