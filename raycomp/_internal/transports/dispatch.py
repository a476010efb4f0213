"""One reduction's layers, each to the transport its compressor declares.

Layers are grouped by transport kind in order of first appearance, and each kind's
collectives are issued in that order: the order is a function of the plan, the names,
shapes and dtypes alone, so it is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist

from raycomp._internal.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Transport

__all__ = ["communicate"]


def communicate(
    kinds: Sequence[Transport], batch: Batch, communicators: Mapping[Transport, Communicator], group: Group,
) -> Pending[Delivered]:
    """Start every transport of ``batch`` (layer ``i`` by ``kinds[i]``); finishes with the
    results in the batch's order and the overhead bytes of all of them.

    ``batch.control`` rides with the first transport that carries control (the dense
    all-reduce), or, if none is in the batch, takes a tiny all-reduce of its own, issued
    last. Its bytes are on the wire either way: they are charged as overhead.
    """
    routes: dict[Transport, list[int]] = {}
    for i, kind in enumerate(kinds):
        routes.setdefault(kind, []).append(i)
    control = batch.control
    overhead = 0.0
    if control is not None:
        overhead += group.allreduce_bytes(control.numel() * control.element_size())
    in_flight: list[tuple[list[int], Pending[Delivered]]] = []
    for kind, members in routes.items():
        communicator = communicators[kind]
        carry, control = (control, None) if communicator.carries_control else (None, control)
        in_flight.append((members, communicator.start(batch.select(members, carry), group)))
    works: list[dist.Work] = [work for _, pending in in_flight for work in pending.works]
    if control is not None:  # no transport here carries it: a collective of its own
        works += group.start_all_reduce(control)

    def finish() -> Delivered:
        reduced: list[Reduced | None] = [None] * len(kinds)
        total = overhead
        for members, pending in in_flight:
            results, extra = pending.finish()
            total += extra
            for i, result in zip(members, results, strict=True):
                reduced[i] = result
        return reduced, total  # type: ignore[return-value]

    return Pending(works, finish)
