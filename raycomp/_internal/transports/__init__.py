"""How payloads travel: one module per transport, each batching all layers it is given.

Every compressor declares a :class:`~raycomp.compressors.Transport` kind; :data:`COMMUNICATORS`
maps each kind to the :class:`~raycomp._internal.transports.base.Communicator` that carries it, and
:func:`~raycomp._internal.transports.dispatch.communicate` hands each layer of a reduction to its
kind's communicator. A new transport is one module with one ``Communicator`` subclass,
listed here.

=================  ==========================================================================
``dense``          the gradients, all-reduced (:mod:`raycomp._internal.transports.dense`)
``allreduce``      element-wise summable payloads, all-reduced (:mod:`~raycomp._internal.transports.summable`)
``allgather``      sparse payloads, all-gathered, summed by scatter-add (:mod:`~raycomp._internal.transports.sparse`)
``scalable``       quantized chunks: all-to-all, reduce, recompress, all-gather (:mod:`~raycomp._internal.transports.scalable`)
``lowrank``        PowerSGD: all-reduce P, orthogonalise, all-reduce Q (:mod:`~raycomp._internal.transports.lowrank`)
=================  ==========================================================================

Every transport returns a :class:`~raycomp._internal.transports.work.Pending`: it runs the work up
to its *last* collective, issues that one asynchronously and returns;
:meth:`~raycomp._internal.transports.work.Pending.wait` waits for it and does the rest (decoding,
averaging). Earlier rounds (PowerSGD's P, the all-to-all of the scalable scheme, the
element counts of variable-size payloads) are waited for inside, so all collectives are
issued by the caller's thread, in the caller's order. The DDP hook uses the split to
compress the next bucket while this one is on the wire. Wire bytes follow the model in
:mod:`raycomp._internal.transports.base`.
"""

from __future__ import annotations

from raycomp._internal.transports.base import OVERHEAD, Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.dense import DenseAllreduce, dense_allreduce, mean_in_place
from raycomp._internal.transports.dispatch import communicate
from raycomp._internal.transports.lowrank import LowRankAllreduce, lowrank_allreduce
from raycomp._internal.transports.packing import buffer_view, to_device
from raycomp._internal.transports.scalable import ScalableAllreduce, gathered_mean
from raycomp._internal.transports.sparse import SparseAllgather, sparse_allgather
from raycomp._internal.transports.summable import SummableAllreduce, summable_allreduce
from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Transport

#: The communicator class of every transport kind.
COMMUNICATORS: dict[Transport, type[Communicator]] = {
    cls.kind: cls
    for cls in (DenseAllreduce, SummableAllreduce, SparseAllgather, ScalableAllreduce, LowRankAllreduce)
}


def communicators() -> dict[Transport, Communicator]:
    """A fresh communicator for every transport kind (one reducer's: some keep state)."""
    return {kind: cls() for kind, cls in COMMUNICATORS.items()}


__all__ = [
    "COMMUNICATORS",
    "OVERHEAD",
    "Batch",
    "Communicator",
    "DenseAllreduce",
    "Delivered",
    "Group",
    "LowRankAllreduce",
    "Pending",
    "Reduced",
    "ScalableAllreduce",
    "SparseAllgather",
    "SummableAllreduce",
    "buffer_view",
    "communicate",
    "communicators",
    "dense_allreduce",
    "gathered_mean",
    "lowrank_allreduce",
    "mean_in_place",
    "sparse_allgather",
    "summable_allreduce",
    "to_device",
]
