"""Compression-aware learning rate: after each dense -> compressed switch the LR ramps from
``start_factor`` x to 1 x over ``warmup_steps`` steps (``compression.lr_scaling``)."""

from __future__ import annotations

from typing import Any

from raycomp.config import LrScalingSection

__all__ = ["LrRamp"]


class LrRamp:
    def __init__(self, options: LrScalingSection) -> None:
        self.options = options
        self.started_at: int | None = None  # the step compression last (re)started

    def factor(self, step: int) -> float:
        if not self.options.enabled or self.started_at is None:
            return 1.0
        done = (step - self.started_at) / self.options.warmup_steps
        return 1.0 if done >= 1 else self.options.start_factor + (1 - self.options.start_factor) * done

    def optimizer_step(self, optimizer: Any, step: int) -> None:
        """``optimizer.step()`` with every group's LR scaled by :meth:`factor` for this step."""
        factor = self.factor(step)
        saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] *= factor
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr
