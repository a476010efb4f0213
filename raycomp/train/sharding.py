"""``strategy="fsdp"``: shard a worker's model with FSDP2 (``fully_shard``), the way
``ray.train.torch.prepare_model`` wraps it in DDP for ``strategy="ddp"``."""

from __future__ import annotations

import torch
from torch import nn

from raycomp.train.options import TrainOptions, with_adaptive


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become ``fully_shard`` units below the root: every child of an
    ``nn.ModuleList`` or ``nn.Sequential`` that holds parameters (a transformer's blocks, a
    sequential network's layers), outermost containers first, never one inside another.

    Each unit is one reduce-scatter and one plan entry; the root takes what is left
    (embeddings, heads). Apply ``fully_shard`` yourself for another split: raycomp keeps it.
    """
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        for child in module.children():
            if any(p.requires_grad for p in child.parameters()):
                units.append(child)
                inside.update(id(m) for m in child.modules())
    return units


def shard_model(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` on ``device`` with ``fully_shard`` on :func:`default_units` and the root
    (unless it is already sharded), and ``optimizer`` pointed at the sharded parameters.
    ``reduce_dtype``: FSDP's own ``MixedPrecisionPolicy(reduce_dtype=...)`` (the bf16
    baseline; raycomp's comms replace the reduce-scatter otherwise).

    ``fully_shard`` replaces each parameter by a sharded one, so an optimizer built before
    it would step tensors no longer in the model; its parameter groups are re-pointed here,
    by parameter name, before it has any state.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return model
    if any(optimizer.state.values()):
        raise ValueError("optimizer: it already has state; build it before training starts "
                         "(raycomp re-points it at the sharded parameters)")
    names = {id(p): name for name, p in model.named_parameters()}
    model.to(device)  # keeps each parameter's identity (module.to replaces .data)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for unit in default_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        except KeyError:
            raise ValueError("optimizer: it holds a parameter that is not in the model; build it "
                             "over model.parameters()") from None
    return model


def sharded_options(options: TrainOptions) -> TrainOptions:
    """``options`` as a sharded run registers them: the adaptive policy told the run is
    sharded (int4, int8, bf16 or dense per unit, priced as a reduce-scatter)."""
    return with_adaptive(options, {"sharded": True})
