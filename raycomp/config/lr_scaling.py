"""``compression.lr_scaling``: the learning-rate ramp after a switch to compressed steps."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from raycomp.config.base import Strict


class LrScalingSection(Strict):
    """Compression-aware learning rate: ramp LR after a dense -> compressed switch."""

    config_key = "compression.lr_scaling"

    #: whether the LR ramps after each switch from dense to compressed
    enabled: bool = False
    #: steps the ramp takes, from ``start_factor`` x the learning rate back to 1 x
    warmup_steps: Annotated[int, Field(ge=1)] = 50
    #: the learning rate's factor at the first compressed step after a switch
    start_factor: Annotated[float, Field(gt=0, le=1)] = 0.5


__all__ = ["LrScalingSection"]
