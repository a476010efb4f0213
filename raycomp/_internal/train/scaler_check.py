"""Which ``torch.amp.GradScaler`` raycomp.train can follow, checked before the loop is built
(:func:`raycomp.train.prepare_model`)."""

from __future__ import annotations

from typing import Any

from raycomp._internal.reduce.loss_scale import check_scaler
from raycomp._internal.train.options import TrainOptions

__all__ = ["refuse_scaler"]


def refuse_scaler(grad_scaler: Any, options: TrainOptions) -> None:
    """A one-line error for a GradScaler raycomp.train cannot follow."""
    check_scaler(grad_scaler)
    if grad_scaler is not None and grad_scaler.is_enabled() and options.strategy == "fsdp":
        raise ValueError("grad_scaler: not supported with strategy 'fsdp'; allowed there: None "
                         "(train in bf16, which needs no loss scaling)")
    if grad_scaler is not None and grad_scaler.is_enabled() and options.compression.local.mode != "off":
        # each rank's scaler would follow its own overflows: the scales would drift apart
        raise ValueError("grad_scaler: not supported with compression.local.mode "
                         f"{options.compression.local.mode!r}; allowed there: None (train in bf16)")
