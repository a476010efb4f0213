"""What a trial is scored by, after every epoch: the number Tune ranks and ASHA compares."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["METRIC", "TIME_ATTR", "Objective"]

METRIC = "objective"  # the result key Tune optimises
TIME_ATTR = "epochs_done"  # the result key ASHA counts time in


class Objective:
    """Scores a trial after each epoch from cumulative wire bytes and its evaluation metric
    (``metric``: "accuracy", higher is better, or "loss", lower is better).

    ``accuracy_at_budget`` (maximise) / ``loss_at_budget`` (minimise): the best so far of the
    metric made worse in proportion to the byte overshoot, ``over = max(1, wire_bytes / budget)``:
    ``accuracy / over`` or ``loss * over``. The metric counts in full while the trial is within
    the byte budget.
    ``bytes_to_target`` / ``time_to_target`` (minimise): the wire bytes / seconds at the
    first epoch that reached the target; before that, the linear projection
    ``spent * target / accuracy`` or ``spent * loss / target``.
    """

    def __init__(self, kind: str, metric: str = "accuracy", byte_budget: float | None = None,
                 target: float | None = None):
        self.kind, self.budget, self.target = kind, byte_budget, target
        self.lower = metric == "loss"
        self.best = math.inf if self.lower else -math.inf
        self.reached: float | None = None

    def update(self, value: float, wire_bytes: float, elapsed_s: float) -> dict[str, Any]:
        if self.kind.endswith("_at_budget"):
            over = max(1.0, wire_bytes / self.budget)
            score = value * over if self.lower else value / over
            self.best = min(self.best, score) if self.lower else max(self.best, score)
            return {METRIC: self.best, "within_budget": wire_bytes <= self.budget}
        spent = wire_bytes if self.kind == "bytes_to_target" else elapsed_s
        if self.reached is None and (value <= self.target if self.lower else value >= self.target):
            self.reached = spent
        if self.reached is not None:
            return {METRIC: self.reached, "reached_target": True}
        shortfall = value / self.target if self.lower else self.target / max(value, 1e-3)
        return {METRIC: spent * shortfall, "reached_target": False}
