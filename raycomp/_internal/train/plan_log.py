"""The run's plan timeline, on rank 0: one log line per switch of the plan in force, and the
same as a line of ``plans.jsonl`` in the output directory (what ``raycomp inspect`` reads,
so the timeline does not depend on the controller outliving the run).

A switch is any change of the plan the ranks train on: a new plan from the controller
(``kind: plan``, with the decision's rule and facts that ride in :attr:`raycomp.plan.Plan.why`),
the guard's fallback to dense and its recovery (``fallback``, ``recovered``); the first
line of a run (``start``) or of a resumed one (``resume``) names the plan it starts on.
Every rank installs the same plans at the same steps; only rank 0 writes them down.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raycomp._internal.observe.run_report import why_text
from raycomp._internal.train.step_log import show_progress, truncate
from raycomp.plan import Plan

__all__ = ["PlanLog", "compressible_layers"]

log = logging.getLogger("raycomp.train")


def compressible_layers(layers: dict[str, list[int]], min_compress_numel: int) -> list[str]:
    """The layers a plan can compress (smaller ones travel dense whatever it says): what a
    plan's summary counts, e.g. "topk(ratio=0.01) on 12/14 layers"."""
    return [name for name, shape in layers.items() if math.prod(shape) >= min_compress_numel]


class PlanLog:
    """Rank 0's plan timeline (other ranks: nothing). ``layers``: the model's layer names,
    for the plans' summaries (:meth:`raycomp.plan.Plan.summary`).

    Rank 0 makes the ``raycomp`` logger's INFO lines visible (:func:`show_progress`) unless
    the application configured that logger: a switch line logged without a handler would
    print nothing."""

    def __init__(self, output_dir: Path, rank: int, layers: Sequence[str]) -> None:
        self.path, self.rank, self.layers = Path(output_dir) / "plans.jsonl", rank, list(layers)
        if rank == 0:
            show_progress()

    def summary(self, plan: Plan) -> str:
        """``plan`` in a few words (over this model's layers)."""
        return plan.summary(self.layers)

    def open(self, plan: Plan, resume_step: int | None) -> None:
        """Start the timeline with the plan the run starts on; after a resume keep the lines
        of steps before ``resume_step`` (the steps after it will be trained again)."""
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            truncate(self.path, resume_step)
        self._append(resume_step or 0, "start" if resume_step is None else "resume", None, plan)

    def switch(self, step: int, kind: str, before: Plan, after: Plan, held: Plan | None = None) -> None:
        """Rank 0: ``after`` replaces ``before`` from ``step`` on (``kind``: plan, fallback,
        recovered): one INFO line (when, from what, to what, why) and one JSON line.
        ``held``: the controller's plan while the guard holds the ranks dense (then a new
        controller plan is recorded with its own rule and reason, ``to`` saying it waits)."""
        if self.rank != 0:
            return
        if held is not None and kind == "plan":
            record = self._append(step, kind, before, held, f"dense (the guard holds; then {self.summary(held)})")
        else:
            record = self._append(step, kind, before, after)
        log.info("step %d: plan v%d %s -> %s [%s]", step, after.version, record["from"], record["to"],
                 why_text(record))

    def _append(self, step: int, kind: str, before: Plan | None, after: Plan,
                to: str | None = None) -> dict[str, Any]:
        record = {"step": step, "kind": kind, "version": after.version,
                  "from": None if before is None else self.summary(before), "to": to or self.summary(after),
                  "rule": after.rule or None, "reason": after.reason, "why": dict(after.why) or None,
                  "dense": after.dense, "time": time.time()}
        with self.path.open("a") as timeline:
            timeline.write(json.dumps(record, default=str) + "\n")
        return record
