"""A piecewise plan by step, e.g. DGC's exponentially shrinking density during warm-up.

Lin et al., "Deep Gradient Compression", ICLR 2018, Sec. 3.3 (warm-up training: density
75%, 25%, 6.25%, 1.5625%, 0.4% over the first epochs).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from controllers.policies.base import Policy, PolicyOptions, spec
from controllers.state import RunState
from raycomp.config.base import CompressorConfig, Strict, compressor
from raycomp.plan import Plan


class ScheduleStage(Strict):
    start_step: Annotated[int, Field(ge=0)]
    compressor: CompressorConfig


class ScheduleOptions(PolicyOptions):
    """``compression.schedule``: stages by step, e.g. DGC's exponential density warm-up."""

    not_shardable = None
    stages: list[ScheduleStage] = [
        ScheduleStage(start_step=0, compressor=compressor("topk", ratio=0.25)),
        ScheduleStage(start_step=50, compressor=compressor("topk", ratio=0.06)),
        ScheduleStage(start_step=100, compressor=compressor("topk", ratio=0.015)),
        ScheduleStage(start_step=150, compressor=compressor("topk", ratio=0.004)),
    ]

    @field_validator("stages")
    @classmethod
    def _increasing(cls, stages: list[ScheduleStage]) -> list[ScheduleStage]:
        if not stages:
            raise ValueError("at least one stage is required")
        starts = [s.start_step for s in stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"start_step values must strictly increase, got {starts}")
        return stages

    def check_sharded(self, key: str) -> None:
        for i, stage in enumerate(self.stages):
            self.check_fits_a_shard(f"{key}.stages[{i}].compressor", stage.compressor)


class SchedulePolicy(Policy):
    name = "schedule"
    options_model = ScheduleOptions
    options: ScheduleOptions

    def __init__(self, options: ScheduleOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.stages = sorted(options.stages, key=lambda s: s.start_step)

    def decide(self, run: RunState) -> Plan:
        # the plan applies from the step after this boundary
        next_step = run.step + 1
        current = self.stages[0]
        for stage in self.stages:
            if stage.start_step <= next_step:
                current = stage
        return Plan(default=spec(current.compressor), reason=f"schedule stage from step {current.start_step}")


__all__ = ["ScheduleOptions", "SchedulePolicy", "ScheduleStage"]
