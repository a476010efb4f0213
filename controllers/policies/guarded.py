"""Keep the controller from publishing compressed plans while the workers are in fallback.

The fallback state machine (non-finite gradient, loss spike and compression-error
triggers; ``stable_steps`` hysteresis before compressing again) lives on the workers in
``raycomp/guard.py``: every rank runs it on the same inputs (the reduced gradient's norm,
and control floats that ride in the step's gradient collective; ``raycomp/train/guard_step.py``)
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

from typing import Any

from controllers.policies.base import Policy
from controllers.state import RunState
from raycomp.plan import Plan


class Guarded(Policy):
    def __init__(self, policy: Policy) -> None:
        super().__init__(policy.options, policy.min_numel)
        self.inner = policy
        self.name = policy.name
        self.suppressed = 0
        self.last: Plan | None = None  # the inner policy's latest plan

    def decide(self, run: RunState) -> Plan | None:
        plan = self.inner.decide(run)
        if plan is not None:
            self.last = plan
        return self._unless_fallback(run, self.last)

    def warmup(self, run: RunState) -> Plan | None:
        return self._unless_fallback(run, self.inner.warmup(run))

    def _unless_fallback(self, run: RunState, plan: Plan | None) -> Plan | None:
        """``plan``, or dense while the workers are in fallback (a suppressed decision)."""
        if run.fallback_active:
            self.suppressed += 1
            return Plan(dense=True, reason="guard: workers in fallback")
        return plan

    def details(self) -> dict[str, Any]:
        return {**self.inner.details(), "guard_suppressed_decisions": self.suppressed}

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "suppressed": self.suppressed,
                "last": None if self.last is None else self.last.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return  # nothing saved yet: start fresh
        self.inner.load_state_dict(state["inner"])
        self.suppressed = int(state["suppressed"])
        self.last = None if state["last"] is None else Plan.from_dict(state["last"])


__all__ = ["Guarded"]
