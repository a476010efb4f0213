"""What raycomp's DDP hook must know of the DDP it runs inside: the process group its own
collectives may use, the order of DDP's parameters in its map of used ones, and the
gradients DDP would hand over that no compressor encodes (see :mod:`raycomp._internal.ddp.hook`)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["hook_group", "reducer_order", "refuse_sparse_gradients", "timeout_of"]


def reducer_order(ddp: torch.nn.Module) -> list[torch.Tensor]:
    """DDP's parameters in its reducer's order (the index of its map of used parameters):
    each module's own trainable parameters, modules in ``named_modules()`` order, shared
    ones once, ignored ones left out."""
    ignored, seen, order = getattr(ddp, "parameters_to_ignore", set()), set(), []
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ignored and id(p) not in seen:
                seen.add(id(p))
                order.append(p)
    return order


def refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """ValueError for an embedding built with ``sparse=True``: its gradient is a sparse
    tensor, which DDP hands to a hook as a bucket of its own and no compressor encodes.
    With ``sparse=False`` the same table goes through the plan like any layer."""
    for name, layer in getattr(model, "module", model).named_modules():
        if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and layer.sparse \
                and layer.weight.requires_grad:
            raise ValueError(f"model: {name!r} is an {type(layer).__name__} with sparse=True; "
                             "raycomp reduces dense gradients only: build it with sparse=False")


def timeout_of(group: Any) -> datetime.timedelta | None:
    """The timeout ``group`` was created with (``None``: torch's default), so that a hung
    collective on the hook's group fails when one on DDP's would; ``dist.new_group`` alone
    gives gloo 30 minutes whatever ``init_process_group`` was told."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):  # no backend for that device; another torch
            continue
    return None


def hook_group(model: torch.nn.Module, process_group: Any) -> Any:
    """The group the hook's collectives travel on: ``process_group`` as given, or for
    ``None`` a new group over every rank (``None`` outside a multi-process run). Raises
    ValueError where the hook and DDP would race on one group, or where DDP reduces over
    other ranks than the new group would span."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return process_group
    ddp_group = getattr(model, "process_group", None) if isinstance(
        model, torch.nn.parallel.DistributedDataParallel) else None
    if process_group is None:
        if ddp_group is not None and dist.get_world_size(ddp_group) != dist.get_world_size():
            raise ValueError(
                f"process_group: DDP reduces over {dist.get_world_size(ddp_group)} of the "
                f"{dist.get_world_size()} ranks; pass a group over DDP's ranks that DDP does not "
                "use (dist.new_group(ranks)), or None only when DDP spans every rank")
        return dist.new_group(timeout=timeout_of(ddp_group or dist.group.WORLD))
    if process_group is ddp_group and getattr(model, "find_unused_parameters", False):
        raise ValueError(
            "process_group: DDP's own group, which DDP uses during backward (find_unused_parameters); "
            "pass None (a group of the hook's own) or another group over the same ranks")
    return process_group
