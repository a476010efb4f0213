"""What a step tells every rank beside its gradients: whether this rank's compressed
gradients were finite, and a few control values staged by the caller.

Non-finite gradients cost no device-to-host wait per layer: each reduction's :func:`all_finite` stays a
tensor, folded into one flag read once, when the step ends. Only compressed layers are
checked: a dense layer's NaN/Inf reaches the mean itself, the same on every rank (the guard
reads it from the mean's norm), while compression may drop it (a threshold test such as
DGC's sampled Top-K is false for NaN) or hide which rank sent it.

Control values ride inside the last reduction of the next step — appended to its dense
fp32 all-reduce, or a tiny all-reduce of their own — so that a caller can learn a few
numbers from every rank without a collective of its own. Each rank's row also carries its
local non-finite flag, first. Values staged as skippable are left out of a step that DDP's
own reduction carries (:meth:`StepSignals.drop`): there they would need that tiny
all-reduce, a collective round a step. The callers' layouts are named in :mod:`raycomp._internal.wire.control_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from raycomp._internal.transports import Group, to_device

__all__ = ["StepSignals", "all_finite"]


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Whether every element of ``tensors`` is finite, as a 0-d bool tensor (no device-to-host wait);
    None when there is no element. A min and a max per tensor decide it: both propagate NaN
    and reach an infinity of their sign. ``isfinite(t).all()`` builds a boolean tensor first,
    several times slower on a CPU, on the hook's thread next to backward. On CUDA, where each tensor's two kernel launches
    cost more than the work, the largest magnitude of each (``torch._foreach_norm`` at
    infinity, NaN propagating as in ``clip_grad_norm_``) comes from one multi-tensor kernel
    per dtype."""
    present = [t for t in tensors if t.numel()]
    if not present:
        return None
    if not present[0].is_cuda:
        return torch.isfinite(torch.stack([torch.stack(torch.aminmax(t)).float() for t in present])).all()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in present:
        by_dtype.setdefault(t.dtype, []).append(t)
    largest = [torch.stack(torch._foreach_norm(group, math.inf)).float() for group in by_dtype.values()]
    return torch.isfinite(torch.cat(largest)).all()


class StepSignals:
    """One rank's finiteness flag for the current step and its staged control row."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.finite: torch.Tensor | None = None  # all compressed gradients of this step finite so far
        self.staged: list[float] | None = None  # rides with the next step's last reduction
        self.skippable = False  # whether the staged values may stay home (:meth:`drop`)
        self.rows: torch.Tensor | None = None  # (world, n) rows of every rank, after that
        self.skipped = False  # this step carried no values: they were dropped

    def begin_step(self) -> None:
        self.finite = None
        self.rows = None
        self.skipped = False

    def watch(self, compressed: Sequence[torch.Tensor]) -> None:
        """Fold the finiteness of compressed layers' gradients into the step's flag (no
        device-to-host wait: read once, by :meth:`nonfinite`)."""
        finite = all_finite(compressed)
        if finite is not None:
            self.finite = finite if self.finite is None else self.finite & finite

    def nonfinite(self) -> bool:
        """Whether a gradient watched this step held NaN/Inf (the step's one device-to-host wait for it)."""
        return self.finite is not None and not bool(self.finite)

    def stage(self, values: Sequence[float], skippable: bool = False) -> None:
        """Sum ``[local non-finite flag, *values]`` of every rank in the next step's last reduction.

        After that step :attr:`rows` holds one row per rank (rank ``r``'s values in row
        ``r``: a sum of one-hot rows is an all-gather). Every rank must stage the same
        number of values, every step it wants them; nothing staged, nothing carried.
        ``skippable``: a step that would need a collective of their own may leave them out
        (:meth:`drop`); every rank must pass the same.
        """
        self.skippable = skippable
        n = 1 + len(values)
        row = [0.0] * (self.group.size * n)
        start = self.group.rank * n
        row[start + 1:start + n] = [float(v) for v in values]
        self.staged = row  # a tensor only when a step takes it: a dense step may drop it

    def take(self, device: torch.device) -> torch.Tensor | None:
        """The staged control row on ``device``, with this rank's non-finite flag filled in
        (no device-to-host wait); :attr:`rows` views it, summed over ranks once its reduction is done."""
        if self.staged is None:
            return None
        row, self.staged = self.staged, None
        self.skippable = False
        control = to_device(torch.tensor(row, dtype=torch.float32), device)  # no device-to-host wait on the hot path
        n = control.numel() // self.group.size
        if self.finite is not None:
            control[self.group.rank * n] = (~self.finite).to(control.dtype)
        self.rows = control.view(self.group.size, n)
        return control

    def drop(self) -> bool:
        """Leave this step's staged values out if they are skippable (then :attr:`rows`
        stays None and :attr:`skipped` is True). Returns whether they were dropped."""
        if self.staged is None or not self.skippable:
            return False
        self.staged, self.skippable, self.skipped = None, False, True
        return True
