"""What :func:`raycomp.train.prepare_model` and :func:`raycomp.train.step` accept besides
the model and the loss, checked before anything runs: when a scheduler steps, and the
norm to clip the reduced gradient to."""

from __future__ import annotations

import math
from typing import Any, Literal

__all__ = ["SchedulerInterval", "check_clip", "check_scheduler"]

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
