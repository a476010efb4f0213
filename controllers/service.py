"""The controller service: one async Ray actor serving every run on the cluster.

Workers call :meth:`ControllerService.ingest` fire-and-forget and rank 0 polls
:meth:`ControllerService.plan`; neither ever waits on a decision. When every rank's report
of a boundary step has arrived, the run's policy (wrapped by the guard) decides, and a
changed plan gets the next version. State is snapshotted as JSON (atomic rename) so a
restarted actor (``max_restarts``) resumes steering the same runs. Runs are keyed by run
id; finished runs are dropped after a grace period, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from controllers.policies import make_policy
from controllers.policies.base import Policy
from controllers.state import RunState
from raycomp.plan import GradStats, Plan

log = logging.getLogger("raycomp.controller")

MAX_RUNS = 256
MAX_REPORT_BYTES = 4 << 20
SNAPSHOT_EVERY_S = 2.0  # routine state
SNAPSHOT_URGENT_S = 0.5  # after a plan change: soon, but coalesced (a snapshot costs ~100 ms)


class Controller:
    """The actor's logic, usable (and tested) as a plain object."""

    def __init__(self, snapshot_dir: str | None = None, finished_run_grace_s: float = 300.0) -> None:
        self.runs: dict[str, RunState] = {}
        self.policies: dict[str, Policy] = {}
        self.rejected: Counter[str] = Counter()
        self.reports = 0
        self.restored = False
        self.grace_s = finished_run_grace_s
        self.snapshot_path = Path(snapshot_dir) / "controller.json" if snapshot_dir else None
        self._last_snapshot = 0.0
        self._dirty = False
        self._urgent = False
        self._restore()

    # --- runs -----------------------------------------------------------------------------
    def register_run(self, run_id: str, world_size: int, layers: dict[str, int], policy: str,
                     options: dict[str, Any], warmup_steps: int, interval_steps: int,
                     min_compress_numel: int, eval_kind: str = "accuracy") -> dict[str, Any]:
        """Start steering ``run_id`` (idempotent: a resumed run keeps its state)."""
        if run_id in self.runs:
            run = self.runs[run_id]
            run.status, run.finished = "running", None
            return run.plan.to_dict()
        options = {**options, "min_compress_numel": min_compress_numel}
        self.policies[run_id] = make_policy(policy, options)
        run = RunState(run_id, world_size, layers, policy, options, warmup_steps, interval_steps, eval_kind)
        self.runs[run_id] = run
        if warmup_steps == 0:  # no warm-up: the first plan is the policy's, known before step 0
            self._decide(run)
        self._evict()
        self.snapshot(force=True)
        return run.plan.to_dict()

    def ingest(self, report: Any) -> bool:
        """Take one rank's report; malformed or unknown ones are counted and dropped."""
        self.reports += 1
        try:
            if _approx_size(report) > MAX_REPORT_BYTES:
                raise ValueError("report too large")
            stats = GradStats.from_dict(report)
        except (ValueError, TypeError) as error:
            self._reject("too_large" if "too large" in str(error) else "malformed", error)
            return False
        run = self.runs.get(stats.run_id)
        if run is None:
            self._reject("unknown_run", stats.run_id)
            return False
        try:
            merged = run.add(stats)
        except (ValueError, TypeError) as error:
            self._reject("malformed", error)
            return False
        if merged:
            self._decide(run)
        return True

    def _decide(self, run: RunState) -> None:
        policy = self.policies[run.run_id]
        if run.step + 1 < run.warmup_steps:
            plan: Plan | None = Plan(reason="warm-up: dense")
        else:
            plan = policy.decide(run)
        if plan is not None:
            before = run.plan.version
            run.install(plan)
            if run.plan.version != before:
                log.info("run %s: plan %d (%s)", run.run_id, run.plan.version, run.plan.reason)
                self._urgent = True
        self._dirty = True
        self.flush()

    def plan(self, run_id: str, known_version: int = -1) -> dict[str, Any] | None:
        """The run's plan if newer than ``known_version`` (None: keep yours)."""
        run = self.runs.get(run_id)
        if run is None or run.plan.version <= known_version:
            return None
        return run.plan.to_dict()

    def finish_run(self, run_id: str, status: str) -> dict[str, Any]:
        run = self.runs.get(run_id)
        if run is None:
            raise ValueError(f"unknown run {run_id!r}")
        run.status, run.finished = status, time.time()
        self.snapshot(force=True)
        return self.summary(run_id)

    def summary(self, run_id: str) -> dict[str, Any]:
        run = self.runs[run_id]
        return {
            "policy": run.policy,
            "policy_details": self.policies[run_id].details(),
            "plan_version": run.plan.version,
            "plan_switches": run.plan_switches,
            "fallback_events": run.fallback_events,
            "events": list(run.events),
            "reports": run.reports,
            "last_step": run.step,
        }

    def health(self) -> dict[str, Any]:
        return {"runs": len(self.runs), "reports": self.reports, "rejected": dict(self.rejected),
                "restored": self.restored}

    def _reject(self, reason: str, detail: Any) -> None:
        self.rejected[reason] += 1
        if self.rejected[reason] in (1, 10, 100) or self.rejected[reason] % 1000 == 0:
            log.warning("rejected report (%s, %d so far): %s", reason, self.rejected[reason], detail)

    def _evict(self) -> None:
        now = time.time()
        for run_id in [r for r, s in self.runs.items() if s.finished and now - s.finished > self.grace_s]:
            self._drop(run_id)
        while len(self.runs) > MAX_RUNS:
            finished = [r for r, s in self.runs.items() if s.finished]
            self._drop(min(finished, key=lambda r: self.runs[r].finished) if finished else next(iter(self.runs)))

    def _drop(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.policies.pop(run_id, None)

    # --- snapshots -------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the snapshot if it is due. Many plan changes in a burst (every run at the
        same boundary) coalesce into one write instead of stalling every report behind
        one ~100 ms write each; the actor also calls this periodically."""
        if not self._dirty:
            return
        wait = SNAPSHOT_URGENT_S if self._urgent else SNAPSHOT_EVERY_S
        if time.monotonic() - self._last_snapshot >= wait:
            self.snapshot(force=True)

    def snapshot(self, force: bool = False) -> None:
        if self.snapshot_path is None:
            return
        now = time.monotonic()
        if not force and now - self._last_snapshot < SNAPSHOT_EVERY_S:
            return
        self._last_snapshot, self._dirty, self._urgent = now, False, False
        data = {
            "version": 1,
            "runs": {rid: run.to_dict() for rid, run in self.runs.items()},
            "policies": {rid: p.state_dict() for rid, p in self.policies.items()},
            "rejected": dict(self.rejected),
            "reports": self.reports,
        }
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.snapshot_path)

    def _restore(self) -> None:
        if self.snapshot_path is None or not self.snapshot_path.exists():
            return
        try:
            data = json.loads(self.snapshot_path.read_text())
            for run_id, state in data["runs"].items():
                run = RunState.from_dict(state)
                policy = make_policy(run.policy, run.options)
                policy.load_state_dict(data["policies"].get(run_id, {}))
                self.runs[run_id], self.policies[run_id] = run, policy
            self.rejected.update(data.get("rejected", {}))
            self.reports = data.get("reports", 0)
            self.restored = True
            log.warning("controller restored %d runs from %s", len(self.runs), self.snapshot_path)
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.error("controller snapshot %s unreadable, starting empty: %s", self.snapshot_path, error)


def _approx_size(obj: Any, limit: int = MAX_REPORT_BYTES) -> int:
    """Cheap upper-bounded size estimate of a nested report (stops past ``limit``)."""
    total, stack = 0, [obj]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, dict):
            total += 8 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 8 * len(item)
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            total += len(item)
        else:
            total += 8
    return total


class ControllerService:
    """The Ray actor wrapper (async: calls never block each other for long).

    :meth:`plan` is a long poll: it answers as soon as a plan newer than the caller's
    exists, or after ``wait_s`` with ``None``. Rank 0 never waits on it (it checks the
    reference with ``ray.wait(timeout=0)`` at each boundary), so a decision reaches the
    workers at the first boundary after it is made.
    """

    def __init__(self, snapshot_dir: str | None = None, finished_run_grace_s: float = 300.0,
                 metrics: dict[str, Any] | None = None) -> None:
        logging.basicConfig(level=logging.INFO)
        self.controller = Controller(snapshot_dir, finished_run_grace_s)
        self.exporter = None
        if metrics is not None:
            from controllers.exporter import Exporter

            self.exporter = Exporter(self.controller, metrics["host"], metrics["port"], metrics.get("sd_file"))
        self._new_plan = asyncio.Event()  # set (and replaced) whenever any run's plan changes
        self._flusher: asyncio.Task | None = None

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_URGENT_S)
            self.controller.flush()

    def _ensure_flusher(self) -> None:
        # started lazily: the actor's event loop is not running yet in __init__
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    def _notify(self) -> None:
        self._new_plan.set()
        self._new_plan = asyncio.Event()

    async def register_run(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.controller.register_run(*args, **kwargs)

    async def ingest(self, report: Any) -> bool:
        self._ensure_flusher()
        run = self.controller.runs.get(report.get("run_id")) if isinstance(report, dict) else None
        before = run.plan.version if run else None
        accepted = self.controller.ingest(report)
        if run is not None and run.plan.version != before:
            self._notify()
        return accepted

    async def plan(self, run_id: str, known_version: int = -1, wait_s: float = 0.0) -> dict[str, Any] | None:
        deadline = time.monotonic() + min(max(wait_s, 0.0), 60.0)
        while True:
            answer = self.controller.plan(run_id, known_version)
            remaining = deadline - time.monotonic()
            if answer is not None or remaining <= 0:
                return answer
            try:
                await asyncio.wait_for(self._new_plan.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    async def finish_run(self, run_id: str, status: str) -> dict[str, Any]:
        return self.controller.finish_run(run_id, status)

    async def summary(self, run_id: str) -> dict[str, Any]:
        return self.controller.summary(run_id)

    async def health(self) -> dict[str, Any]:
        return self.controller.health()

    async def pid(self) -> int:
        return os.getpid()

    async def metrics_url(self) -> str | None:
        return None if self.exporter is None else self.exporter.url


def get_or_create(name: str, namespace: str, snapshot_dir: str | None, max_restarts: int = -1,
                  finished_run_grace_s: float = 300.0, metrics: dict[str, Any] | None = None) -> Any:
    """The named controller actor, created detached (outlives any one driver) if absent.

    Scheduled with the "DEFAULT" strategy so that, created from inside a Tune trial or any
    task in a placement group, it is not captured by that group and killed with it.
    """
    import ray

    actor = ray.remote(ControllerService).options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=max_restarts, max_concurrency=64, scheduling_strategy="DEFAULT",
    )
    return actor.remote(snapshot_dir, finished_run_grace_s, metrics)
