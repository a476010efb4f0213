"""What :func:`raycomp.train.prepare_model` and :func:`raycomp.train.step` accept besides
the model and the loss, checked before anything runs: when a scheduler steps
(:class:`SchedulerSteps` steps it then), and the norm to clip the reduced gradient to."""

from __future__ import annotations

import math
from typing import Any, Literal

__all__ = ["SchedulerInterval", "SchedulerSteps", "check_clip", "check_scheduler"]

#: when a scheduler given to :func:`raycomp.train.prepare_model` steps
SchedulerInterval = Literal["step", "epoch"]


def check_scheduler(scheduler: Any, interval: Any) -> None:
    """A one-line error for a scheduler without its interval, or an interval not allowed."""
    if (scheduler is not None or interval is not None) and interval not in ("step", "epoch"):
        raise ValueError(f"scheduler_interval: must be 'step' or 'epoch' when a scheduler is given, got {interval!r}")


def check_clip(max_norm: Any) -> None:
    """A one-line error for a ``clip_grad_norm`` that is not a positive finite number."""
    if max_norm is None:
        return
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not 0 < max_norm < math.inf:
        raise ValueError(f"clip_grad_norm: must be a positive finite number or None, got {max_norm!r}")


class SchedulerSteps:
    """The run's scheduler (or None), stepped after every step (``"step"``) or after each
    epoch's last (``"epoch"``: where epochs end, only ``loop.epochs(...)`` says)."""

    def __init__(self, scheduler: Any, interval: SchedulerInterval | None) -> None:
        check_scheduler(scheduler, interval)
        self.scheduler, self.interval = scheduler, interval

    def check(self, steps_per_epoch: int | None) -> None:
        """Before a step: a one-line error where epochs end unknown to an epoch's scheduler."""
        if self.scheduler is not None and self.interval == "epoch" and not steps_per_epoch:
            raise RuntimeError("scheduler_interval='epoch': raycomp knows where epochs end only from "
                               "loop.epochs(epochs, steps_per_epoch); iterate that, or pass scheduler_interval='step'")

    def after_step(self) -> None:
        """After the optimizer step (or its skip)."""
        if self.scheduler is not None and self.interval == "step":
            self.scheduler.step()

    def after_steps(self, steps: int, steps_per_epoch: int | None) -> None:
        """After ``steps`` steps in all: the epoch's last step, before its report checkpoints."""
        if self.scheduler is not None and self.interval == "epoch" and steps % steps_per_epoch == 0:  # type: ignore[operator]
            self.scheduler.step()
