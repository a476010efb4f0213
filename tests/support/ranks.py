"""Small helpers for tests that run on real gloo ranks (tests/distributed.py): one rank's
tensors flattened, and a tensor of every rank gathered."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["flat", "gather"]


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (a model's ``parameters()``, say) as one detached 1-D tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t``, in rank order (a collective)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out
