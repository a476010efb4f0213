"""Keep the controller from publishing compressed plans while the workers are in fallback.

The fallback state machine (non-finite gradient, loss spike and compression-error
triggers; ``stable_steps`` hysteresis before compressing again) lives on the workers in
``raycomp/_internal/guard.py``: every rank runs it on the same inputs (the reduced gradient's norm,
and control floats that ride in the step's gradient collective; ``raycomp/_internal/train/step_judge.py``)
and switches to dense in the same step, without asking the controller. The workers report it in
``GradStats.fallback_active``; this wrapper then answers::

    if run.fallback_active:
        inner.decide(run)            # keep its windows and estimates current; result unused
        return Plan(dense=True)      # counted as a suppressed decision
    plan = inner.decide(run)
    return plan if plan is not None else the inner policy's latest plan

so that a plan published during fallback is dense, and compression resumes with the
inner policy's plan at the first boundary after the workers recover. The warm-up's plans
(``warmup``) pass the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raycomp.plan import Plan

from ..state import RunState
from .base import Policy
from .decision import Decision, Said, checked


@dataclass
class GateState:
    suppressed: int = 0  # decisions replaced by dense while the workers were in fallback
    last: Plan | None = None  # the inner policy's latest plan


class FallbackGate(Policy):
    def __init__(self, policy: Policy) -> None:
        super().__init__(policy.options, policy.min_numel)
        self.inner: Policy = policy
        self.name = policy.name
        self.state: GateState = GateState()

    def decide(self, run: RunState) -> Decision | None:
        decision = checked(self.inner.decide(run), self.name)
        if decision is not None:
            self.state.last = decision.plan
        elif self.state.last is not None:  # the inner policy keeps its latest plan
            decision = Decision.of(self.state.last, Said("kept", self.state.last.reason))
        return self._unless_fallback(run, decision)

    def warmup(self, run: RunState) -> Decision | None:
        return self._unless_fallback(run, checked(self.inner.warmup(run), self.name))

    def _unless_fallback(self, run: RunState, decision: Decision | None) -> Decision | None:
        """``decision``, or dense while the workers are in fallback (a suppressed decision)."""
        if run.fallback_active:
            self.state.suppressed += 1
            return Decision.of(Plan(dense=True), Said("guard.fallback", "guard: workers in fallback"))
        return decision

    def details(self) -> dict[str, Any]:
        return {**self.inner.details(), "guard_suppressed_decisions": self.state.suppressed}


__all__ = ["FallbackGate"]
