"""Error feedback: what compression left out is kept per layer and sent later.

Two memories share one protocol, used by ``raycomp._internal.reduce.reducer`` for every layer and step (compensate, then compress
and communicate, then update)::

    compensated = memory.compensate(name, grad)      # before compression
    ...compress / communicate...                      # 'sent' = this rank's contribution
    memory.update(name, compensated, sent, sparse)   # after

* :class:`ResidualMemory` — error feedback (Seide et al., "1-Bit Stochastic Gradient
  Descent", Interspeech 2014; Karimireddy et al., ICML 2019): ``e <- (g + e) - sent``,
  so mass is conserved exactly: ``sent + e_new == g + e_old``.
* :class:`DGCMemory` — Deep Gradient Compression's momentum correction, momentum-factor
  masking and local gradient clipping (Lin et al., ICLR 2018, Algorithm 1 and Sec. 3.2).
  It accumulates the *velocity*, so the optimizer itself must run without momentum.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from raycomp._internal.reduce.loss_scale import rescale

__all__ = ["MEMORIES", "PER_LAYER_STATE", "DGCMemory", "Memory", "NoMemory", "ResidualMemory", "make_memory"]

#: the keys of a memory's ``state_dict`` that hold one tensor per layer (error feedback's
#: residuals; DGC's velocity and accumulation): what a resize merges and a two-level rank
#: holds a piece of
PER_LAYER_STATE = ("residuals", "velocity", "accumulated")

#: The memory kinds :func:`make_memory` builds.
MEMORIES = ("residual", "dgc", "none")


class Memory(Protocol):
    #: The loss scale the gradients carry under fp16 loss scaling (a 0-d tensor; None
    #: without a ``torch.amp.GradScaler``), set by the reducer at each step's start after
    #: :meth:`rescale`. A memory that compares values with an absolute constant (DGC's
    #: ``clip_norm``) multiplies the constant by it.
    loss_scale: torch.Tensor | None

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor: ...

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor, sparse: bool) -> None: ...

    def residual(self, name: str) -> torch.Tensor | None: ...

    def reset(self) -> None: ...

    def idle(self) -> bool:
        """Whether :meth:`compensate` would return every gradient itself and a dense
        :meth:`update` keep nothing (a dense step may then skip both)."""
        ...

    def rescale(self, factor: torch.Tensor) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoMemory:
    """No error feedback: what compression drops is lost."""

    loss_scale: torch.Tensor | None = None

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor, sparse: bool) -> None:
        pass

    def residual(self, name: str) -> torch.Tensor | None:
        return None

    def reset(self) -> None:
        pass

    def idle(self) -> bool:
        return True

    def rescale(self, factor: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ResidualMemory:
    """Error feedback with one residual tensor per layer (absent while it is zero)."""

    loss_scale: torch.Tensor | None = None

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(name)
        return grad if residual is None else grad + residual.to(grad.device, grad.dtype)

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor, sparse: bool) -> None:
        if sent is compensated:  # sent in full (dense): nothing left over
            self.residuals.pop(name, None)
            return
        # the residual is kept in fp32 even for half-precision gradients: it accumulates
        self.residuals[name] = compensated.float() - sent.float()

    def residual(self, name: str) -> torch.Tensor | None:
        return self.residuals.get(name)

    def reset(self) -> None:
        self.residuals.clear()

    def idle(self) -> bool:
        return not self.residuals  # a dense step after compressed ones sends what is left first

    def rescale(self, factor: torch.Tensor) -> None:
        """The gradients' units changed by ``factor`` (a loss scaler's new scale)."""
        rescale(self.residuals.values(), factor)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


class DGCMemory:
    """DGC's local accumulation with momentum correction (Lin et al., ICLR 2018).

    Per layer::

        g <- clip(g, clip_norm / sqrt(world_size))   (local clipping, optional, per layer)
        u <- m * u + g                               (momentum correction)
        v <- v + u                                    (accumulated velocity; compressed)
        after sending: v <- v - sent;  u[sent positions] <- 0   (momentum-factor masking)

    Layers sent in full (dense) keep their momentum: ``v`` empties, ``u`` is not masked,
    which is plain momentum SGD. Clipping is per layer because a comm hook sees one bucket
    at a time, not the whole model's norm. ``clip_norm`` is in the loss's units: under fp16
    loss scaling the limit is multiplied by the scale (``loss_scale``); compared with the
    scaled norm as it is, it would shrink every gradient by about the scale.
    """

    loss_scale: torch.Tensor | None = None

    def __init__(self, momentum: float = 0.9, clip_norm: float | None = None, world_size: int = 1) -> None:
        if not (0.0 <= momentum < 1.0):
            raise ValueError(f"momentum: must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm: must be positive or null, got {clip_norm!r}")
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.world_size = world_size
        self.velocity: dict[str, torch.Tensor] = {}  # u
        self.accumulated: dict[str, torch.Tensor] = {}  # v

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        g = grad.float()
        if self.clip_norm is not None:
            # an fp32 tensor either way: the same rounding with and without a loss scale
            limit = g.new_tensor(self.clip_norm / math.sqrt(self.world_size))
            if self.loss_scale is not None:
                limit = limit * self.loss_scale.to(g.device)
            norm = torch.linalg.vector_norm(g)
            g = g * (limit / norm).clamp(max=1.0)  # no `if norm > limit`: a device-to-host wait
        u = self.velocity.get(name)
        u = g.clone() if u is None else u.to(g.device).mul_(self.momentum).add_(g)
        self.velocity[name] = u
        v = self.accumulated.get(name)
        v = None if v is None else v.to(g.device)
        return (u.clone() if v is None else v + u).to(grad.dtype)

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor, sparse: bool) -> None:
        if sent is compensated:
            self.accumulated.pop(name, None)
            return
        self.accumulated[name] = compensated.float() - sent.float()
        if sparse:
            self.velocity[name].masked_fill_(sent != 0, 0.0)

    def residual(self, name: str) -> torch.Tensor | None:
        return self.accumulated.get(name)

    def reset(self) -> None:
        self.velocity.clear()
        self.accumulated.clear()

    def idle(self) -> bool:
        return False  # momentum correction sends the velocity, on dense layers too

    def rescale(self, factor: torch.Tensor) -> None:
        rescale([*self.velocity.values(), *self.accumulated.values()], factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "velocity": {k: v.clone() for k, v in self.velocity.items()},
            "accumulated": {k: v.clone() for k, v in self.accumulated.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
        self.accumulated = {k: v.clone() for k, v in state["accumulated"].items()}


def make_memory(kind: str, world_size: int) -> Memory:
    """The memory named ``kind`` (one of :data:`MEMORIES`), DGC's with its defaults."""
    if kind == "residual":
        return ResidualMemory()
    if kind == "dgc":
        return DGCMemory(world_size=world_size)
    if kind == "none":
        return NoMemory()
    raise ValueError(f"memory: unknown kind {kind!r}; allowed: {', '.join(MEMORIES)}")
