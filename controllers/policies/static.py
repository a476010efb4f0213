"""One compressor for every layer, all run long."""

from __future__ import annotations

from raycomp.config.policy_options import StaticOptions
from raycomp.controllers.policies.base import Policy, spec
from raycomp.controllers.policies.decision import Decision
from raycomp.controllers.policies.reasons import Said
from raycomp.controllers.state import RunState
from raycomp.plan import Plan


class StaticPolicy(Policy):
    name = "static"
    options_model = StaticOptions
    options: StaticOptions

    def decide(self, run: RunState) -> Decision:
        return Decision.of(Plan(default=spec(self.options.compressor)), Said("static", "static"))


__all__ = ["StaticPolicy"]
