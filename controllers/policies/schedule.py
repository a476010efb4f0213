"""A piecewise plan by step, e.g. DGC's exponentially shrinking density during warm-up.

Lin et al., "Deep Gradient Compression", ICLR 2018, Sec. 3.3 (warm-up training: density
75%, 25%, 6.25%, 1.5625%, 0.4% over the first epochs).
"""

from __future__ import annotations

from dataclasses import dataclass

from raycomp.config.policy_options import ScheduleOptions
from raycomp.plan import Plan

from ..state import RunState
from .base import Policy, spec
from .decision import Decision


@dataclass(frozen=True)
class ScheduleWhy:
    start_step: int  # the stage in force from this step
    rule: str = "schedule.stage"

    def text(self) -> str:
        return f"schedule stage from step {self.start_step}"


class SchedulePolicy(Policy):
    name = "schedule"
    options_model = ScheduleOptions
    options: ScheduleOptions

    def __init__(self, options: ScheduleOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.stages = sorted(options.stages, key=lambda s: s.start_step)

    def decide(self, run: RunState) -> Decision:
        # the plan applies from the step after this boundary
        next_step = run.step + 1
        current = self.stages[0]
        for stage in self.stages:
            if stage.start_step <= next_step:
                current = stage
        return Decision.of(Plan(default=spec(current.compressor)), ScheduleWhy(current.start_step))


__all__ = ["SchedulePolicy", "ScheduleWhy"]
