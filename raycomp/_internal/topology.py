"""Where each rank runs: its node, its place on that node, and the two process groups that follow.

A cluster has two links: a fast one between the ranks of one node (NVLink, PCIe, loopback)
and a slow one between nodes. :class:`Topology` says which ranks share a node; it is found,
not configured (:func:`discover`): from Ray Train's context inside a Ray Train worker
(node rank, local rank, local world size), else from torchrun's environment
(``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), else one rank per node.

:func:`node_groups` builds, on every rank, one process group per node (the intra-node
level) and one across nodes per position on a node (the cross-node level: the ``i``-th
rank of every node), as Horovod's hierarchical all-reduce and INTELLECT-1 lay them out. Every node must
hold the same number of ranks; a cluster that does not is run flat, one level, and
:func:`node_groups` logs why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from raycomp._internal.transports import Group

__all__ = ["Levels", "Topology", "discover", "node_groups"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """This rank's place: ``node`` of ``nodes``, ``local_rank`` of ``per_node`` on it."""

    nodes: int = 1
    per_node: int = 1
    node: int = 0
    local_rank: int = 0

    def __post_init__(self) -> None:
        for field, value, low in (("nodes", self.nodes, 1), ("per_node", self.per_node, 1),
                                  ("node", self.node, 0), ("local_rank", self.local_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"topology.{field}: expected an integer >= {low}, got {value!r}")
        if self.node >= self.nodes or self.local_rank >= self.per_node:
            raise ValueError(f"topology: node {self.node} / local rank {self.local_rank} outside "
                             f"{self.nodes} nodes of {self.per_node} ranks")

    @property
    def two_level(self) -> bool:
        """Whether there are two links to tell apart: several nodes, several ranks on each."""
        return self.nodes > 1 and self.per_node > 1

    @classmethod
    def of_rank(cls, rank: int, nodes: int, per_node: int) -> Topology:
        """The place of world rank ``rank`` when ranks fill nodes in order (``node = rank // per_node``)."""
        return cls(nodes, per_node, rank // per_node, rank % per_node)


def discover() -> Topology:
    """This rank's topology: Ray Train's context, torchrun's environment, or flat.

    Call it inside a worker once the process group exists. Ray Train numbers nodes and local
    ranks itself; a world size that is not nodes x ranks per node (nodes of unequal size)
    comes back flat here, and :func:`node_groups` checks the same across ranks.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    place = _from_ray_train() or _from_torchrun()
    if place is None:
        return Topology()
    node, local_rank, per_node = place
    if per_node < 1 or world % per_node:
        return Topology()
    return Topology(world // per_node, per_node, node, local_rank) if node < world // per_node else Topology()


def _from_ray_train() -> tuple[int, int, int] | None:
    try:
        from ray import train
        context = train.get_context()
        return context.get_node_rank(), context.get_local_rank(), context.get_local_world_size()
    except Exception:  # not in a Ray Train worker (or Ray absent): the next source
        return None


def _from_torchrun() -> tuple[int, int, int] | None:
    names = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not all(name in os.environ for name in names):
        return None
    try:
        node, local_rank, per_node = (int(os.environ[name]) for name in names)
    except ValueError:
        return None
    return node, local_rank, per_node


@dataclass
class Levels:
    """The two groups of a two-level reduction, seen from one rank."""

    topology: Topology
    intra: Group  # the ranks of this node, by local rank
    cross: Group  # the rank at this rank's position in every node, by node

    @property
    def place(self) -> dict[str, int]:
        """This rank's layout, as a checkpoint records it: state kept per piece or shard of
        it (residuals, the scalable route's server residuals) is valid nowhere else."""
        t = self.topology
        return {"nodes": t.nodes, "per_node": t.per_node, "position": self.intra.rank, "cross_rank": self.cross.rank}

    def check_place(self, saved: dict[str, int] | None) -> None:
        """ValueError unless ``saved`` (a checkpoint's layout, None when flat) is :attr:`place`."""
        if saved != self.place:
            raise ValueError(f"compression.levels: this checkpoint's layout {saved or 'flat'} is not this rank's "
                             f"{self.place}; allowed: resume at the same nodes x ranks per node")


def node_groups(topology: Topology) -> Levels | None:
    """Both levels' process groups, or None when the topology has one level.

    Collective: every rank calls it at the same point (it creates ``nodes + per_node`` groups,
    each rank in the same order). Every rank's place is gathered first; where the places do
    not tile nodes x ranks per node (nodes of unequal size, two ranks claiming one place)
    every rank sees the same and runs flat, with a warning naming what each rank said.
    """
    places = [topology]
    if dist.is_initialized() and dist.get_world_size() > 1:
        places = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(places, topology)
    shapes = {(p.nodes, p.per_node) for p in places}
    seats = {(p.node, p.local_rank) for p in places}
    if len(shapes) != 1 or len(seats) != len(places) or len(places) != topology.nodes * topology.per_node:
        log.warning("topology: the ranks' places do not tile nodes x ranks per node, so every rank is its "
                    "own node (flat); each rank's (nodes, per_node, node, local_rank): %s",
                    [(p.nodes, p.per_node, p.node, p.local_rank) for p in places])
        return None
    if not topology.two_level:
        return None
    # torch orders a group's ranks by global rank: position i of a node is its i-th lowest
    # rank (which need not be local rank i), and the cross-node group of position i joins
    # those, so that a piece of the buffer meets the same piece of every node
    members = [sorted(r for r, p in enumerate(places) if p.node == node) for node in range(topology.nodes)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    intra = cross = None
    for node in range(topology.nodes):  # every rank creates every group, in this order
        group = dist.new_group(members[node])
        if rank in members[node]:
            intra = group
    for position in range(topology.per_node):
        ranks = [members[node][position] for node in range(topology.nodes)]
        group = dist.new_group(ranks)
        if rank in ranks:
            cross = group
    return Levels(topology, Group(intra), Group(cross))
