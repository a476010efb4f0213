"""The controller service: one Ray actor serving every run on the cluster.

Workers call :meth:`ControllerService.ingest` fire-and-forget and rank 0 polls
:meth:`ControllerService.plan`; neither ever waits on a decision. The actor holds one
:class:`~raycomp.controllers.controller.Controller` (the decisions and the snapshots) and
answers its calls in concurrency groups under one lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray

from .controller import Controller
from .ray_metrics import EVERY_S as RAY_METRICS_EVERY_S

log = logging.getLogger("raycomp.controller")

INGEST_THREADS = 2  # one decodes the next report while the other holds the state lock
POLL_THREADS = 64  # long polls answered at once (one per running run); more wait their turn
CONCURRENCY_GROUPS = {"ingest": INGEST_THREADS, "poll": POLL_THREADS}
OTHER_CALL_THREADS = 8  # register, finish, summary, health
SNAPSHOT_TICK_S = 0.25  # the actor's snapshot thread wakes this often
SNAPSHOT_BUDGET_S = 0.025  # and saves runs for about this long: ~10% of a core at most


class ControllerService:
    """The Ray actor wrapper: a threaded actor whose calls run in concurrency groups.

    ``ingest`` has :data:`INGEST_THREADS` threads of its own, ``plan`` long polls have
    :data:`POLL_THREADS` (a waiting poll never holds up a report) and the rest share the
    default group; one lock protects the controller's state, which the snapshot and metrics
    exporter threads also read. Threaded rather than async because Ray spends less CPU per
    call on a threaded actor (``docs/benchmarks/history.md``) and ``ingest`` is called by
    every rank of every run; two ingest threads because Ray's hand-off of calls to a single
    thread caps the calls an actor answers per second, and a second thread raises the cap.
    With two, one rank's reports may be applied out of order:
    :class:`~raycomp.controllers.state.RunState` accepts that (a step completed later is merged
    later; running byte totals keep the latest step's).

    :meth:`plan` is a long poll: it answers as soon as a plan newer than the caller's
    exists, or after ``wait_s`` with ``None``. Rank 0 never waits on it (it checks the
    reference with ``ray.wait(timeout=0)`` at each boundary), so a decision reaches the
    workers at the first boundary after it is made.
    """

    def __init__(self, snapshot_dir: str | None = None, finished_run_grace_s: float = 300.0,
                 metrics: dict[str, Any] | None = None, ray_metrics_every_s: float | None = RAY_METRICS_EVERY_S) -> None:
        """``metrics``: the standalone exporter's ``host``, ``port`` and ``sd_file`` (None:
        no exporter). ``ray_metrics_every_s``: how often the same metrics are recorded into
        Ray's metrics API (:mod:`raycomp.controllers.ray_metrics`; None: not at all)."""
        logging.basicConfig(level=logging.INFO)
        self.controller = Controller(snapshot_dir, finished_run_grace_s)
        self.lock = threading.RLock()
        self._plan_changed = threading.Condition(self.lock)
        self.exporter = None
        if metrics is not None:
            from .exporter import Exporter

            self.exporter = Exporter(self.controller, metrics["host"], metrics["port"], metrics.get("sd_file"),
                                     lock=self.lock)
        self.ray_metrics = None
        if ray_metrics_every_s is not None:
            from .exporter import ControllerCollector
            from .ray_metrics import RayMetrics

            self.ray_metrics = RayMetrics(ControllerCollector(self.controller, self.lock))
            self.ray_metrics.start(ray_metrics_every_s)
        threading.Thread(target=self._flush_periodically, name="raycomp-snapshots", daemon=True).start()

    def _flush_periodically(self) -> None:
        failures = 0
        while True:
            time.sleep(SNAPSHOT_TICK_S)
            try:
                with self.lock:
                    self.controller.evict()
                started = time.perf_counter()
                while time.perf_counter() - started < SNAPSHOT_BUDGET_S:
                    with self.lock:  # one run at a time: reports wait for one run's save at most
                        if not self.controller.flush_one():
                            break
            except OSError as error:  # a full or unwritable disk must not stop the steering
                failures += 1
                if failures in (1, 10, 100) or failures % 1000 == 0:
                    log.error("controller snapshots failing (%d so far), runs keep their last saved "
                              "state on disk: %s", failures, error)

    def register_run(self, run_id: str, world_size: int, layers: dict[str, int | list[int]], policy: str,
                     options: dict[str, Any], warmup_steps: int, interval_steps: int,
                     min_compress_numel: int, eval_kind: str = "accuracy", per_node: int = 1,
                     node_link: float | None = None) -> dict[str, Any]:
        """:meth:`Controller.register_run`, under the service's lock."""
        with self.lock:
            return self.controller.register_run(run_id, world_size, layers, policy, options, warmup_steps,
                                                interval_steps, min_compress_numel, eval_kind, per_node,
                                                node_link)

    @ray.method(concurrency_group="ingest")
    def ingest(self, report: Any) -> bool:
        with self.lock:
            run = self.controller.runs.get(report.get("run_id")) if isinstance(report, dict) else None
            before = run.plan.version if run else None
            accepted = self.controller.ingest(report)
            if run is not None and run.plan.version != before:
                self._plan_changed.notify_all()
            return accepted

    @ray.method(concurrency_group="poll")
    def plan(self, run_id: str, known_version: int = -1, wait_s: float = 0.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + min(max(wait_s, 0.0), 60.0)
        with self._plan_changed:
            while True:
                answer = self.controller.plan(run_id, known_version)
                remaining = deadline - time.monotonic()
                if answer is not None or remaining <= 0:
                    return answer
                self._plan_changed.wait(remaining)

    def finish_run(self, run_id: str, status: str) -> dict[str, Any]:
        with self.lock:
            return self.controller.finish_run(run_id, status)

    def summary(self, run_id: str) -> dict[str, Any]:
        with self.lock:
            return self.controller.summary(run_id)

    def health(self) -> dict[str, Any]:
        with self.lock:
            return self.controller.health()

    def pid(self) -> int:
        return os.getpid()

    def metrics_url(self) -> str | None:
        return None if self.exporter is None else self.exporter.url


def get_or_create(name: str, namespace: str, snapshot_dir: str | None, max_restarts: int = -1,
                  finished_run_grace_s: float = 300.0, metrics: dict[str, Any] | None = None,
                  ray_metrics_every_s: float | None = RAY_METRICS_EVERY_S) -> Any:
    """The named controller actor, created detached (outlives any one driver) if absent.

    Placed by Ray's default scheduling (``scheduling_strategy="DEFAULT"``) so that, created
    from inside a Tune trial or any task in a placement group, it is not captured by that
    group and killed with it.
    """
    import ray

    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ControllerService).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=max_restarts, scheduling_strategy="DEFAULT", max_concurrency=OTHER_CALL_THREADS,
    )
    return actor.remote(snapshot_dir, finished_run_grace_s, metrics, ray_metrics_every_s)


__all__ = ["CONCURRENCY_GROUPS", "OTHER_CALL_THREADS", "Controller", "ControllerService", "get_or_create"]
