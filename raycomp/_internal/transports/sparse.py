"""The sparse transport: (values, indices) payloads, all-gathered and summed by scatter-add."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raycomp._internal.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.packing import gather_payloads
from raycomp._internal.transports.work import Group, Pending
from raycomp._internal.wire.payload import Payload
from raycomp.compressors import Compressor, Transport

__all__ = ["SparseAllgather", "sparse_allgather"]


def sparse_allgather(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group
) -> Pending[Delivered]:
    """Sparse payloads: all-gather, then sum by scatter-add (each compressor's
    :meth:`~raycomp.compressors.Compressor.sum_gathered`).

    If any payload can vary in size, every rank first all-gathers the element counts of
    its payload tensors, so all ranks know every peer's layout and the padded length.
    Finishes with the per-layer results and the overhead bytes (counts, padding).
    """
    w = group.size
    payloads = [c.compress(t) for t, c in zip(tensors, compressors, strict=True)]
    sent = [c.decompress(p) for p, c in zip(payloads, compressors, strict=True)]
    gathering, overhead = gather_payloads(payloads, compressors, group)

    def merge(per_rank: list[list[Payload]]) -> Delivered:
        results = []
        for i, payload in enumerate(payloads):
            mean = compressors[i].sum_gathered([rank_payloads[i] for rank_payloads in per_rank]).div_(w)
            results.append(Reduced(mean, sent[i], (w - 1) * payload.nbytes))
        return results, overhead

    return gathering.then(merge)


class SparseAllgather(Communicator):
    """:func:`sparse_allgather` for a batch."""

    kind = Transport.ALLGATHER

    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        return sparse_allgather(batch.tensors, batch.compressors, group)
