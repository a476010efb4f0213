"""The controller's logic, one object serving every run: usable (and tested) as a plain
object; :mod:`raycomp.controllers.service` wraps it in the Ray actor.

When every rank's report of a boundary step has arrived, the run's policy (wrapped by its
fallback gate) decides, and a changed plan gets the next version. Each run's state is
snapshotted as JSON (:mod:`raycomp.controllers.snapshots`) so a restarted actor
(``max_restarts``) resumes steering the same runs. Runs are keyed by run id; finished runs
are dropped after a grace period, so memory stays bounded.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Any

from raycomp.messages import GradStats, ReportTooLarge, is_finite

from .policies import make_policy
from .policies.base import Policy
from .policies.decision import checked
from .snapshots import SnapshotStore
from .state import RunState

log = logging.getLogger("raycomp.controller")

MAX_RUNS = 256
SNAPSHOT_EVERY_S = 2.0  # a run's routine state is saved at most this often
SNAPSHOT_URGENT_S = 0.5  # and a run whose plan changed, this soon


class Controller:
    """The actor's logic, usable (and tested) as a plain object."""

    def __init__(self, snapshot_dir: str | None = None, finished_run_grace_s: float = 300.0) -> None:
        self.runs: dict[str, RunState] = {}
        self.policies: dict[str, Policy] = {}
        self.rejected: Counter[str] = Counter()
        self.reports = 0
        self.restored = False
        self.grace_s = finished_run_grace_s
        self.store = SnapshotStore(snapshot_dir) if snapshot_dir else None
        self._unsaved: dict[str, bool] = {}  # run id -> urgent (its plan changed)
        self._saved_at: dict[str, float] = {}  # run id -> monotonic time of its last save
        self._restore()

    # --- runs -----------------------------------------------------------------------------
    def register_run(self, run_id: str, world_size: int, layers: dict[str, int | list[int]], policy: str,
                     options: dict[str, Any], warmup_steps: int, interval_steps: int,
                     min_compress_numel: int, eval_kind: str = "accuracy", per_node: int = 1,
                     node_link: float | None = None) -> dict[str, Any]:
        """Start steering ``run_id`` (idempotent: a resumed run keeps its state).

        ``layers`` maps parameter names to element counts or, better, shapes: the adaptive
        policy sizes PowerSGD's factors from a shape (from a count it assumes a square).
        ``per_node``: the ranks of a node when compressed steps reduce in two levels
        (``raycomp._internal.reduce.two_level``), 1 when flat; the cost model prices the cross-node hop with it.
        ``node_link``: seconds per byte of an all-reduce inside a node, timed as the run
        started (``raycomp._internal.node_link``); the cost model prices the node's own hops with it.
        None: not timed (those hops are then learned only as part of what a plan measured).
        """
        node_link = checked_node_link(node_link)
        if run_id in self.runs:
            run = self.runs[run_id]
            run.status, run.finished = "running", None
            run.per_node, run.node_link = per_node, node_link
            if world_size != run.world_size:  # an elastic restart at another size: re-measure, re-plan
                log.info("run %s: %d -> %d workers; the link and compute are measured again",
                         run_id, run.world_size, world_size)
                run.resize(world_size)
                for model in self.policies[run_id].cost_models():
                    model.forget()
                self._decide(run)
                self._unsaved[run_id] = True
            return run.plan.to_dict()
        options = {**options, "min_compress_numel": min_compress_numel}
        self.policies[run_id] = make_policy(policy, options)
        run = RunState(run_id, world_size, layers, policy, options, warmup_steps, interval_steps, eval_kind)
        run.per_node, run.node_link = per_node, node_link
        self.runs[run_id] = run
        if warmup_steps == 0:  # no warm-up: the first plan is the policy's, known before step 0
            self._decide(run)
        self.evict()
        self._save(run_id)
        return run.plan.to_dict()

    def ingest(self, report: Any) -> bool:
        """Take one rank's report; malformed or unknown ones are counted and dropped."""
        self.reports += 1
        try:
            stats = GradStats.from_dict(report)
        except ReportTooLarge as error:
            self._reject("too_large", error)
            return False
        except (ValueError, TypeError) as error:
            self._reject("malformed", error)
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
        self._unsaved.setdefault(run.run_id, False)
        if merged:
            self._decide(run)
        return True

    def _decide(self, run: RunState) -> None:
        policy = self.policies[run.run_id]
        decision = checked(policy.warmup(run) if run.step + 1 < run.warmup_steps else policy.decide(run), run.policy)
        if decision is not None:
            before = run.plan.version
            run.install(decision.plan, decision.facts())
            if run.plan.version != before:
                log.info("run %s: plan %d by %s (%s)", run.run_id, run.plan.version, decision.rule, run.plan.reason)
                self._unsaved[run.run_id] = True

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
        self._save(run_id)
        return self.summary(run_id)

    def summary(self, run_id: str) -> dict[str, Any]:
        run = self.runs[run_id]
        return {
            "policy": run.policy,
            "policy_details": self.policies[run_id].details(),
            "plan_version": run.plan.version,
            "plan_switches": run.plan_switches,
            "plan_switches_by_rule": dict(run.switches_by_rule),
            "fallback_events": run.fallback_events,
            "events": list(run.events),
            "reports": run.reports,
            "last_step": run.step,
            # the latest evaluation the ranks reported (their mean), and how to read it
            "eval_metric": run.eval_metric,
            "eval_kind": run.eval_kind,
            # the optimizer's learning rate the ranks reported: the latest and the largest
            "lr": run.lr,
            "peak_lr": run.peak_lr,
        }

    def health(self) -> dict[str, Any]:
        return {"runs": len(self.runs), "reports": self.reports, "rejected": dict(self.rejected),
                "restored": self.restored}

    def _reject(self, reason: str, detail: Any) -> None:
        self.rejected[reason] += 1
        if self.rejected[reason] in (1, 10, 100) or self.rejected[reason] % 1000 == 0:
            log.warning("rejected report (%s, %d so far): %s", reason, self.rejected[reason], detail)

    def evict(self) -> None:
        """Drop runs finished longer than the grace period ago, and the oldest beyond
        ``MAX_RUNS`` (at registration, and periodically in the actor)."""
        now = time.time()
        for run_id in [r for r, s in self.runs.items() if s.finished and now - s.finished > self.grace_s]:
            self._drop(run_id)
        while len(self.runs) > MAX_RUNS:
            finished = [r for r, s in self.runs.items() if s.finished]
            self._drop(min(finished, key=lambda r: self.runs[r].finished) if finished else next(iter(self.runs)))

    def _drop(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.policies.pop(run_id, None)
        self._unsaved.pop(run_id, None)
        self._saved_at.pop(run_id, None)
        if self.store is not None:
            self.store.delete_run(run_id)

    # --- snapshots -------------------------------------------------------------------------
    def flush_one(self) -> bool:
        """Save the run whose snapshot is most due (a changed plan first, then the oldest);
        False when none is. The actor calls this from its own thread, a run at a time,
        within a CPU budget; a plain ``Controller`` user calls :meth:`flush`."""
        if self.store is None or not self._unsaved:
            return False
        now = time.monotonic()
        due = [(not urgent, self._saved_at.get(run_id, -math.inf), run_id)
               for run_id, urgent in self._unsaved.items()
               if now - self._saved_at.get(run_id, -math.inf) >= (SNAPSHOT_URGENT_S if urgent else SNAPSHOT_EVERY_S)]
        if not due:
            return False
        self._save(min(due)[2])
        return True

    def flush(self) -> int:
        """Save every run whose snapshot is due; returns how many were saved."""
        saved = 0
        while self.flush_one():
            saved += 1
        return saved

    def snapshot(self) -> None:
        """Save every run now."""
        for run_id in list(self.runs):
            self._save(run_id)

    def _save(self, run_id: str) -> None:
        if self.store is not None:  # a failed write leaves the run due: it is tried again
            self.store.save_run(run_id, {"run": self.runs[run_id].to_dict(),
                                         "policy": self.policies[run_id].state_dict()})
            self.store.save_meta({"rejected": dict(self.rejected), "reports": self.reports})
            self._saved_at[run_id] = time.monotonic()
        self._unsaved.pop(run_id, None)

    def _restore(self) -> None:
        if self.store is None:
            return
        meta, runs = self.store.load()
        for run_id, state in runs.items():
            try:
                run = RunState.from_dict(state["run"])
                policy = make_policy(run.policy, run.options)
                policy.load_state_dict(state.get("policy") or {})
            except (ValueError, KeyError, TypeError) as error:
                log.error("controller snapshot of run %r unusable, skipped: %s", run_id, error)
                continue
            self.runs[run_id], self.policies[run_id] = run, policy
        if meta is not None:
            self.rejected.update(meta.get("rejected", {}))
            self.reports = meta.get("reports", 0)
        self.restored = meta is not None or bool(self.runs)
        if self.restored:
            log.warning("controller restored %d runs from %s", len(self.runs), self.store.directory)


def checked_node_link(value: Any) -> float | None:
    """A registration's ``node_link`` as a float, or ValueError naming what is allowed."""
    if value is None:
        return None
    if not is_finite(value) or value <= 0:
        raise ValueError(f"node_link: expected None or a finite number of seconds per byte > 0, got {value!r}")
    return float(value)


__all__ = ["MAX_RUNS", "Controller", "checked_node_link"]
