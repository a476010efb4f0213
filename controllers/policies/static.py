"""One compressor for every layer, all run long."""

from __future__ import annotations

from raycomp.config.policy_options import StaticOptions
from raycomp.plan import Plan

from ..state import RunState
from .base import Policy, spec
from .decision import Decision, Said


class StaticPolicy(Policy):
    name = "static"
    options_model = StaticOptions
    options: StaticOptions

    def decide(self, run: RunState) -> Decision:
        return Decision.of(Plan(default=spec(self.options.compressor)), Said("static", "static"))


__all__ = ["StaticPolicy"]
