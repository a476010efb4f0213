"""A user's policy with typed options, in one file: Top-K whose density halves every
``every_steps`` steps from ``start_ratio`` down to ``min_ratio`` (a DGC-like warm-up).

Register it (``raycomp.controllers.policies.register_policy("ramp", "tests.support.ramp_policy:RampPolicy")``)
or name it by its import path; its options come from ``compression.custom_options``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from raycomp.controllers.policies import Decision, Policy, PolicyOptions, Said
from raycomp.controllers.policies.base import compressible_layers
from raycomp.controllers.state import RunState
from raycomp.plan import CompressorSpec, Plan


class RampOptions(PolicyOptions):
    """``compression.custom_options`` of the ramp policy."""

    start_ratio: Annotated[float, Field(gt=0, le=1)] = 0.25
    min_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01
    every_steps: Annotated[int, Field(ge=1)] = 50

    @model_validator(mode="after")
    def _falls(self) -> RampOptions:
        if self.min_ratio > self.start_ratio:
            raise ValueError(f"min_ratio: must be <= start_ratio ({self.start_ratio}), got {self.min_ratio}")
        return self


class RampPolicy(Policy):
    name = "ramp"
    options_model = RampOptions
    options: RampOptions

    def ratio(self, step: int) -> float:
        """The density from the step after a boundary at ``step``."""
        return max(self.options.min_ratio, self.options.start_ratio / 2 ** ((step + 1) // self.options.every_steps))

    def decide(self, run: RunState) -> Decision:
        topk = CompressorSpec.of("topk", ratio=self.ratio(run.step))
        return Decision.of(Plan.per_layer(dict.fromkeys(compressible_layers(run, self.min_numel), topk)),
                           Said("ramp", f"ramp: topk {self.ratio(run.step):g}"))
