"""Tensors made equal over the replicas, laid back to back in one buffer that makes one
collective: their mean (the replicas' buffers at a sync) or rank 0's (the inner optimizer's
state when local steps end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast_in_place", "first_rank", "mean_in_place"]


def first_rank(group: Any) -> int:
    """The global rank of ``group``'s rank 0 (the default group's: 0)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def mean_in_place(tensors: Sequence[torch.Tensor], group: Any, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Each of ``tensors`` becomes its mean over the ranks of ``group``, reduced in ``dtype``
    (on ``device``, else where the tensors lie) in one all-reduce. A collective; returns the
    buffer that travelled."""
    buffer = _joined(tensors, dtype, device)
    dist.all_reduce(buffer, group=group)
    buffer /= dist.get_world_size(group)
    _scatter(buffer, tensors)
    return buffer


def broadcast_in_place(tensors: Sequence[torch.Tensor], group: Any, dtype: torch.dtype = torch.float64,
                       device: torch.device | str | None = None) -> None:
    """Each of ``tensors`` becomes rank 0's, through one broadcast in ``dtype``. A collective."""
    buffer = _joined(tensors, dtype, device)
    dist.broadcast(buffer, src=first_rank(group), group=group)
    _scatter(buffer, tensors)


def _joined(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(dtype) if device is None else t.detach().reshape(-1).to(device, dtype)
                      for t in tensors])


def _scatter(buffer: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in into:
            t.copy_(buffer[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
