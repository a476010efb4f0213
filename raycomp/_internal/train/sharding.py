"""``strategy="fsdp"``: shard a worker's model with FSDP2 (``fully_shard``), the way
``ray.train.torch.prepare_model`` wraps it in DDP for ``strategy="ddp"``, and compress each
unit's reduce-scatter as the plan says (:class:`~raycomp._internal.fsdp.state.ShardedState`).

On several nodes of several workers (``compression.levels: auto``, the topology found as
for DDP) the model is sharded over each node's workers and replicated across nodes (HSDP's
layout): dense inside a node, each shard's mean compressed across nodes
(:mod:`raycomp._internal.fsdp.two_level`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raycomp._internal.topology import Levels, discover, node_groups
from raycomp._internal.train.gradient_strategy import GradientStrategy, StrategySetup
from raycomp.plan import Plan

__all__ = ["FsdpStrategy", "default_units", "fsdp_strategy", "shard_model", "sharded_state", "sharding_levels"]


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
                reduce_dtype: torch.dtype | None = None, levels: Levels | None = None,
                mesh: Any = None) -> nn.Module:
    """``model`` on ``device`` with ``fully_shard`` on :func:`default_units` and the root
    (unless it is already sharded), and ``optimizer`` pointed at the sharded parameters.
    ``reduce_dtype``: FSDP's own ``MixedPrecisionPolicy(reduce_dtype=...)``, for FSDP's own
    reduce-scatter (raycomp's comms replace it, and ignore this, once installed).
    ``levels``: shard over this rank's node only (:func:`raycomp._internal.fsdp.two_level.node_mesh`);
    ``mesh``: this device mesh (torch's own HSDP: a 2-D one); neither: over every rank.

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
    if mesh is None and levels is not None:
        from raycomp._internal.fsdp.two_level import node_mesh

        mesh = node_mesh(levels, device.type)
    if mesh is None:
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


class FsdpStrategy(GradientStrategy):
    """A :class:`~raycomp.train.gradient_strategy.GradientStrategy` over a ``fully_shard`` model and
    its :class:`~raycomp._internal.fsdp.state.ShardedState`: plans name units, not parameters."""

    sharded = True
    per_step = True  # every step's gradients are reduced
    bucket_cap_mb = None  # no DDP buckets

    def __init__(self, model: nn.Module, state: Any) -> None:
        self.model, self.state = model, state

    @property
    def per_node(self) -> int:
        """The ranks of a node when the model is sharded per node (two levels), else 1."""
        return self.state.per_node

    def time_node_link(self) -> float | None:
        """Seconds per byte inside a node, timed (two levels), else None. Collective."""
        return self.state.time_node_link()

    def layers(self) -> dict[str, list[int]]:
        return {name: [numel] for name, numel in self.state.sizes.items()}

    def end_backward(self) -> None:
        self.state.end_backward()  # FSDP reduce-scattered in backward; close the step

    def after_optimizer_step(self, applied: bool, loss: float) -> None:
        return None  # per step: the gradients were reduced in backward

    def agreement(self) -> tuple[float, ...]:
        return ()


def sharded_state(model: nn.Module, setup: StrategySetup, *, install: bool = True,
                  levels: Levels | None = None) -> Any:
    """The rank's :class:`~raycomp._internal.fsdp.state.ShardedState` over ``model``, as the run's
    options say (dense plan). ``install=False`` keeps the units' own reduce-scatter;
    ``levels``: ``model`` is sharded per node, its shards cross nodes compressed."""
    from raycomp._internal.fsdp.state import ShardedState

    c = setup.options.compression
    return ShardedState(model, Plan(), min_compress_numel=c.min_compress_numel, seed=setup.options.seed,
                        stats_every=setup.options.controller.interval_steps, error_feedback=c.memory != "none",
                        install=install, control_group=setup.control_group, levels=levels)


def sharding_levels(setup: StrategySetup) -> Levels | None:
    """Both levels' groups where the run has several nodes of several workers and
    ``compression.levels`` is ``auto``, else None. Collective (it creates the groups)."""
    return node_groups(discover()) if setup.options.compression.levels == "auto" else None


def fsdp_strategy(model: nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> FsdpStrategy:
    """raycomp's FSDP2 path: ``fully_shard`` on :func:`default_units` and the root, each
    unit's reduce-scatter compressed per destination shard."""
    levels = sharding_levels(setup)
    model = shard_model(model, optimizer, setup.device, levels=levels)
    return FsdpStrategy(model, sharded_state(model, setup, levels=levels))
