"""``compression.guard``: when the workers' guard falls back to dense all-reduce."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from raycomp.config.base import Strict


class GuardSection(Strict):
    """Fallback to dense all-reduce, acted on by every rank in the same step."""

    config_key = "compression.guard"

    #: whether the guard falls back to dense (off: never; a step with a non-finite gradient
    #: or loss is still skipped)
    enabled: bool = True
    #: a loss spike: the mean loss of the last ``spike_steps`` steps above this factor x the
    #: ``spike_quantile`` quantile of the ``loss_window`` losses before them
    loss_spike_factor: Annotated[float, Field(gt=1)] = 3.0
    #: the steps of losses (and of gradient norms) a spike is compared against
    loss_window: Annotated[int, Field(ge=3, le=10_000)] = 20
    #: fall back when a layer's compression error exceeds this: on the DDP path the error of
    #: the mean every rank applied against the exact mean, on each statistics step, judged
    #: at the next agreement, for compressors that run with error feedback (an unbiased one
    #: is noisy by design); with FSDP each rank's own. 2 leaves room above what healthy runs
    #: reach (docs/benchmarks/guard-mean-error.md)
    max_compression_error: Annotated[float, Field(gt=0)] = 2.0
    #: clean steps in dense fallback before compressing again (hysteresis)
    stable_steps: Annotated[int, Field(ge=1)] = 50
    #: a gradient explosion: the reduced gradient's norm above this factor x the
    #: ``spike_quantile`` quantile of the last ``loss_window`` norms; the step is skipped too
    grad_norm_factor: Annotated[float, Field(gt=1)] = 10.0
    #: the quantile of a window that a spike is compared to (0.9: the 90th percentile, not
    #: the median: late per-batch losses are small and heavy-tailed)
    spike_quantile: Annotated[float, Field(ge=0.5, le=1)] = 0.9
    #: the loss is averaged over this many steps before it is compared (one hard batch is
    #: not a divergence, a sustained rise is)
    spike_steps: Annotated[int, Field(ge=1, le=1000)] = 5


__all__ = ["GuardSection"]
