"""One compressor for every layer, all run long."""

from __future__ import annotations

from controllers.policies.base import Policy, spec
from controllers.state import RunState
from raycomp.plan import Plan


class StaticPolicy(Policy):
    name = "static"

    def decide(self, run: RunState) -> Plan:
        return Plan(default=spec(self.options["compressor"]), reason="static")
