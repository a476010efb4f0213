"""The inner optimizer's state when replicas come back together.

During local steps every replica steps its own inner optimizer on its own gradients, so its
state (SGD's momentum, Adam's moments and step count, a GradScaler's scale) is its own, as
DiLoCo keeps it. Merging the replicas makes the weights equal, but not that state: a
per-step plan after local steps would then apply the same mean gradient through different
momenta, and the ranks' weights would drift apart for ever (nothing in per-step training
re-synchronises the weights). :func:`equalize_inner_state` makes it equal on every rank
before per-step training resumes:

- a state tensor shaped like its parameter (a moment) becomes the mean over the ranks: the
  first moment of a synchronous run is exactly the average of the replicas' moments when
  they saw the same steps (an exponential average is linear), the nearest common value
  for the second;
- every other entry (step counts, scalars) becomes rank 0's;
- where the ranks' states do not have the same layout (a rank whose every inner step was
  skipped holds no state yet), every rank takes rank 0's whole state;
- a GradScaler's scale becomes the smallest over the ranks (the one that overflowed on no
  rank), its growth count restarts.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.local.replica_mean import broadcast_in_place, first_rank, mean_in_place

__all__ = ["equalize_inner_state"]


def equalize_inner_state(optimizer: torch.optim.Optimizer, grad_scaler: Any = None, group: Any = None) -> None:
    """Make ``optimizer``'s state (and ``grad_scaler``'s scale) the same on every rank of
    ``group``, as the module says. A collective: every rank calls it at the same step.
    ``group`` is a gloo group (raycomp's control group): the values travel on the CPU."""
    entries = _entries(optimizer)
    digest = torch.tensor([_digest(entries)], dtype=torch.int64)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(digests, digest, group=group)
    if any(int(d) != int(digest) for d in digests):
        _take_rank0(optimizer, group)
    else:
        _average(entries, group)
    if grad_scaler is not None and grad_scaler.is_enabled():
        _equal_scale(grad_scaler, group)


def _entries(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(parameter, key, value) of every tensor in the state, in the optimizer's own order
    (its groups' parameter lists), keys sorted: the same order on every rank."""
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            out += [(param, key, state[key]) for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return out


def _digest(entries: list[tuple[torch.Tensor, str, torch.Tensor]]) -> int:
    text = ";".join(f"{key}:{tuple(value.shape)}:{value.dtype}" for _, key, value in entries)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def _is_moment(param: torch.Tensor, value: torch.Tensor) -> bool:
    return value.is_floating_point() and value.shape == param.shape and value.numel() > 0


def _average(entries: list[tuple[torch.Tensor, str, torch.Tensor]], group: Any) -> None:
    moments = [value for param, _, value in entries if _is_moment(param, value)]
    others = [value for param, _, value in entries if not _is_moment(param, value) and value.numel() > 0]
    if moments:
        mean_in_place(moments, group, torch.float64, "cpu")
    if others:  # step counts and scalars: rank 0's, exactly (any dtype)
        broadcast_in_place(others, group, torch.float64, "cpu")


def _take_rank0(optimizer: torch.optim.Optimizer, group: Any) -> None:
    state = [optimizer.state_dict()]
    dist.broadcast_object_list(state, src=first_rank(group), group=group)
    optimizer.load_state_dict(state[0])


def _equal_scale(grad_scaler: Any, group: Any) -> None:
    """The smallest scale on every rank (``get_scale()`` is the initial one on a rank that
    has not scaled yet: it takes part all the same, and starts from the result)."""
    smallest = torch.tensor([float(grad_scaler.get_scale())], dtype=torch.float64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group)
    scale, tracker = getattr(grad_scaler, "_scale", None), getattr(grad_scaler, "_growth_tracker", None)
    with torch.no_grad():
        if scale is None:  # created at its first use, from the initial scale
            grad_scaler._init_scale = float(smallest)
        else:
            scale.fill_(float(smallest))
        if tracker is not None:
            tracker.zero_()
