"""Statistics from every rank to the controller: fire-and-forget, bounded, outages counted."""

from __future__ import annotations

import logging
import math
from typing import Any

from raycomp.messages import GradStats

__all__ = ["MAX_REPORTS_IN_FLIGHT", "Outages", "StatsReporter"]

log = logging.getLogger("raycomp.train")

MAX_REPORTS_IN_FLIGHT = 8  # per rank; beyond it the next report is dropped (and counted)


class Outages:
    """Calls to the controller that failed; training goes on under the last plan."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, error: BaseException, plan_version: int) -> None:
        self.count += 1
        if self.count == 1 or self.count % 100 == 0:
            log.warning("controller unreachable (%d so far); training continues on plan %d: %s",
                        self.count, plan_version, error)


class StatsReporter:
    """Collects per-step timings and losses; at a boundary sends one :class:`GradStats`."""

    def __init__(self, controller: Any, run_id: str, rank: int, outages: Outages) -> None:
        self.controller, self.run_id, self.rank, self.outages = controller, run_id, rank, outages
        self.dropped = 0
        self.events: list[dict[str, Any]] = []  # guard events not yet reported
        self.eval_metric: float | None = None  # the latest evaluation, not yet reported
        self._losses: list[float] = []
        self._timings: list[tuple[float, float, int]] = []  # (step s, comm s, samples)
        #: the first interval not sent yet: its first step (DDP building its buckets, the
        #: allocator warming up) is left out of its timing where the interval has others,
        #: so it does not inflate the compute the adaptive policy prices every plan with
        self._first = True
        self._pending: list[Any] = []
        # the last interval sent: (step, loss, step s, comm s, samples/s); a final call with
        # nothing new but an evaluation or events sends it again, carrying them
        self._last: tuple[int, float, float, float, float] | None = None

    def record(self, loss: float, step_s: float, comm_s: float, samples: int) -> None:
        self._timings.append((step_s, comm_s, samples))
        self._losses.append(loss)

    def send(self, state: Any, step: int, epoch: int, fallback_active: bool, final: bool = False,
             skipped_steps: int = 0, loss_scale: float | None = None, outer_steps: int = 0,
             lr: float | None = None) -> None:
        """Report the interval since the last call (``state``: the rank's CompressionState;
        ``skipped_steps`` and ``outer_steps``: this rank's totals so far; ``loss_scale``: the
        GradScaler's, if any; ``lr``: the optimizer's learning rate now)."""
        timings, losses = self._timings, self._losses
        self._timings, self._losses = [], []
        if self.controller is None:
            return
        if self._first and len(timings) > 1:
            timings = timings[1:]
        self._first = self._first and not timings
        if timings:
            step_s = sum(t for t, _, _ in timings) / len(timings)
            finite = [v for v in losses if math.isfinite(v)]
            self._last = (step, math.fsum(finite) / len(finite) if finite else 0.0, step_s,
                          sum(c for _, c, _ in timings) / len(timings),
                          sum(n for _, _, n in timings) / max(1e-9, sum(t for t, _, _ in timings)))
        elif not (final and (self.eval_metric is not None or self.events)
                  and self._last is not None and self._last[0] == step):
            if final:  # nothing new since the last boundary
                self.reap(wait_s=10)
            return
        # else: the run ended on a boundary and evaluated after it: the boundary's interval
        # again, now with the evaluation (the controller adds no timing sample for a repeat)
        self.reap()
        if len(self._pending) >= MAX_REPORTS_IN_FLIGHT and not final:
            # backpressure: a controller that falls behind must not queue without bound
            self.dropped += 1
            if self.dropped in (1, 10, 100):
                log.warning("controller is behind: %d statistics reports dropped", self.dropped)
            return
        _, loss, step_s, comm_s, samples_per_second = self._last
        stats = GradStats(
            run_id=self.run_id, rank=self.rank, step=step, epoch=epoch, plan_version=state.plan.version,
            loss=loss, step_seconds=step_s, compute_seconds=max(0.0, step_s - comm_s), comm_seconds=comm_s,
            samples_per_second=samples_per_second,
            wire_bytes=state.ledger.wire_total, dense_bytes=state.ledger.dense_total,
            intra_bytes=state.intra_bytes, fallback_active=fallback_active,
            layers=tuple(s.to_dict() for s in state.stats if _finite_stats(s)),
            events=tuple(self.events), eval_metric=self.eval_metric, outages=self.outages.count,
            skipped_steps=skipped_steps, loss_scale=loss_scale, outer_steps=outer_steps, lr=lr,
        )
        self.events, self.eval_metric = [], None
        try:
            ref = self.controller.ingest.remote(stats.to_dict())
            if final:  # the process may exit next: make sure the last totals arrive
                import ray

                ray.get(ref, timeout=10)
            else:
                self._pending.append(ref)
        except Exception as error:  # noqa: BLE001 - the controller is optional at run time
            self.outages.add(error, state.plan.version)

    def reap(self, wait_s: float = 0) -> None:
        import ray

        if not self._pending:
            return
        ready, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:  # noqa: BLE001
                self.outages.add(error, -1)


def _finite_stats(stats: Any) -> bool:
    return all(math.isfinite(v) for v in (stats.grad_norm, stats.compression_error, stats.residual_norm))
