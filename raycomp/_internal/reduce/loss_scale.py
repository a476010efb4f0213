"""Error feedback under fp16 loss scaling (``torch.amp.GradScaler``).

A GradScaler multiplies the loss, hence every gradient the hook sees, by a scale ``S`` that
changes as training goes: x2 after ``growth_interval`` clean steps, x0.5 after a step that
overflowed (whose update it skips). Error-feedback memory holds what compression left out
in the units of the step that left it. After ``S -> S'`` that residual must be multiplied
by ``S'/S`` before it joins the next gradient; kept as it is, it counts twice after a
backoff and half after a growth, and a scale that changes every few steps moves the run
away from the one without a scaler. Followed, powers of two make it the same run, bit for
bit (``tests/test_loss_scale.py``).

The scale is read as the scaler's own tensor (``GradScaler._scale``): its public
``get_scale()`` copies it to the host, a device-to-host wait per step on CUDA. Following it costs one
multiply over the memory per step (a fused multi-tensor kernel on CUDA).

Statistics are divided by the scale too, so the controller sees gradient norms in the
units of the loss: a growth would otherwise look like a gradient that doubled (the
critical-regime test compares norms across windows).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ScaleFollower", "check_scaler", "current_scale", "rescale", "unscale_once"]


def check_scaler(grad_scaler: Any) -> None:
    """A one-line error unless ``grad_scaler`` is None or a torch GradScaler."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError(f"grad_scaler: expected a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")


def current_scale(grad_scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The scale of the backward in progress, as the scaler's tensor (no device-to-host wait); None
    without a scaler, with a disabled one, or before its first ``scale()``."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    return grad_scaler._scale


def unscale_once(grad_scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """``grad_scaler.unscale_(optimizer)`` unless the caller already did this step (to clip
    the gradients, torch's recipe): a second call raises. Reads the scaler's per-optimizer
    stage, a private field that has held it since torch 1.6."""
    from torch.amp.grad_scaler import OptState

    if grad_scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
        grad_scaler.unscale_(optimizer)


def rescale(tensors: Iterable[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d ``factor``, one fused kernel per device
    (a memory loaded onto the CPU may sit beside a CUDA factor until its layer is next used)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        torch._foreach_mul_(group, factor.to(device))


class ScaleFollower:
    """The loss scale the error-feedback memory is in, and by how much it changed.

    Call :meth:`change` once per step, before the memory is used: it returns ``S'/S`` as a
    0-d tensor (no device-to-host wait), or None when there is nothing to follow yet.
    """

    def __init__(self, grad_scaler: torch.amp.GradScaler | None) -> None:
        check_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self.scale: torch.Tensor | None = None  # the scale the memory's values are in

    def change(self) -> torch.Tensor | None:
        scale = current_scale(self.grad_scaler)
        if scale is None:
            return None
        factor = None if self.scale is None else scale / self.scale.to(scale.device)
        self.scale = scale.clone()  # the scaler's update() changes its tensor in place
        return factor

    def unscale(self) -> float:
        """What divides a measured norm to put it in the loss's units (a host read)."""
        return 1.0 if self.scale is None else float(self.scale)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": None if self.scale is None else float(self.scale)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = None if state["scale"] is None else torch.tensor(float(state["scale"]))
