"""FSDP2 in two levels: shard inside each node, and only each shard's mean crosses nodes,
compressed.

HSDP's layout (FSDP inside a node, replicas across nodes) with raycomp's compression on
the slow hop only. Each node of ``L`` ranks shards the model over its own group (a 1-D
mesh per node, :func:`node_mesh`), so a unit's backward takes two hops:

1. **inside the node, dense**: FSDP's reduce-scatter over the node's group
   (raycomp's :class:`~raycomp._internal.fsdp.reduce_scatter.CompressedReduceScatter` at ``none``: fp32 rows in
   one all-to-all, the node's bytes counted). Local rank ``i`` holds shard ``i`` of the
   node's mean.
2. **across nodes, compressed**: FSDP hands that shard to the unit's all-reduce hook
   (``FSDPModule.set_all_reduce_hook``, before its own post-division), where
   :class:`CrossNodeShards` reduces it over the rank's cross-node group (rank ``i`` of
   every node) with the ordinary compressed reduction
   (:class:`~raycomp._internal.reduce.reducer.CompressedReducer`: compensate, compress, communicate,
   decompress, update memory), in place. The ``L`` positions of a node cross in
   parallel, each with ``1/L`` of the unit, and error feedback keeps one residual per
   shard on the rank that sends it.

No gradient all-gather follows: FSDP all-gathers the *parameters* inside the node before
the next forward, as it does anyway. So the slow link carries each node's share of one
all-reduce of the model, compressed, and the parameters never cross nodes; a flat FSDP
run sends every rank's reduce-scatter and all-gathers across nodes. One quantization per
step whatever ``W`` is (two on the scalable route past two nodes, as flat).

The plan names units, as on the flat sharded path, and applies to the cross-node hop
(inside a node the exchange is always dense). Every node holds the same weights after
every step: the shard's mean is computed identically at each position on every node (the
cross-node transports agree across their group).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from raycomp._internal.reduce.reducer import CompressedReducer
from raycomp._internal.topology import Levels
from raycomp._internal.wire.ledger import WireLedger
from raycomp.plan import Plan

__all__ = ["CrossNodeShards", "node_mesh"]


def node_mesh(levels: Levels, device_type: str) -> Any:
    """The 1-D device mesh of this rank's node, for ``fully_shard(..., mesh=...)``."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(levels.intra.handle, device_type)


class CrossNodeShards:
    """The cross-node hop of every unit: its shard of the node's mean, reduced over this
    rank's cross-node group as the plan says.

    Args:
        levels: the node's group and this position's cross-node group
            (:func:`raycomp._internal.topology.node_groups`).
        memory, min_compress_numel, seed, stats_every: as in
            :class:`~raycomp._internal.reduce.reducer.CompressedReducer`, over the shards
            (``min_compress_numel`` applies to a shard).
    """

    def __init__(self, levels: Levels, *, memory: str = "residual", min_compress_numel: int = 1024,
                 seed: int = 0, stats_every: int = 0) -> None:
        self.levels = levels
        self.reducer = CompressedReducer(process_group=levels.cross.handle, memory=memory,
                                         min_compress_numel=min_compress_numel, seed=seed, stats_every=stats_every)
        self.seconds = 0.0  # time spent in the hops, whole run

    @property
    def ledger(self) -> WireLedger:
        """The bytes that crossed nodes, each shard beside a dense all-reduce of it there."""
        return self.reducer.ledger

    def set_plan(self, plan: Plan) -> None:
        self.reducer.set_plan(plan)

    def hook(self, unit: str) -> Callable[[torch.Tensor], None]:
        """``unit``'s all-reduce hook: its shard, reduced across nodes in place."""

        def reduce_across_nodes(shard: torch.Tensor) -> None:
            started = time.perf_counter()
            mean = self.reducer.start([unit], [shard], overwrite=True).wait()[0]
            if mean.data_ptr() != shard.data_ptr():
                shard.copy_(mean)
            self.seconds += time.perf_counter() - started

        return reduce_across_nodes

    def end_step(self) -> None:
        """After backward: close the step (the reducer's plan, step count, memory on a
        non-finite step)."""
        self.reducer.end_step()

    def state_dict(self) -> dict[str, Any]:
        return {**self.reducer.state_dict(), "levels": self.levels.place}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume bit for bit at the same place; another layout is refused (its residuals
        are other shards)."""
        self.levels.check_place(state.get("levels"))
        self.reducer.load_state_dict({k: v for k, v in state.items() if k != "levels"})
