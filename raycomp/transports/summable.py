"""The summable transport: payloads that add up element-wise (casts, shared-index Random-K),
one all-reduce per dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from raycomp.compressors import Compressor, Transport
from raycomp.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp.transports.packing import by_dtype, split
from raycomp.transports.work import Group, Pending

__all__ = ["SummableAllreduce", "summable_allreduce"]


def summable_allreduce(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group
) -> Pending[list[Reduced]]:
    """Payloads that add up element-wise (casts, shared-index Random-K): one all-reduce.

    Inputs are divided by the world size before compression so the sum is the mean and a
    half-precision sum cannot overflow (as torch's ``fp16_compress_hook``).
    """
    w = group.size
    payloads = [c.compress(t / w) for t, c in zip(tensors, compressors, strict=True)]
    sent = [c.decompress(p) * w for p, c in zip(payloads, compressors, strict=True)]
    wire_tensors = [t for p in payloads for t in p.tensors.values()]
    works: list[dist.Work] = []
    flats: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    for indices in by_dtype(wire_tensors):
        members = [wire_tensors[i] for i in indices]
        flat = torch.cat([t.reshape(-1) for t in members])
        works += group.start_all_reduce(flat)
        flats.append((members, flat))

    def finish() -> list[Reduced]:
        for members, flat in flats:
            for t, total in zip(members, split(flat, members), strict=True):
                t.copy_(total)  # payload tensors now hold the sums
        return [
            Reduced(c.decompress(p), s, group.allreduce_bytes(p.nbytes))
            for p, c, s in zip(payloads, compressors, sent, strict=True)
        ]

    return Pending(works, finish)


class SummableAllreduce(Communicator):
    """:func:`summable_allreduce` for a batch (no overhead bytes)."""

    kind = Transport.ALLREDUCE

    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        return summable_allreduce(batch.tensors, batch.compressors, group).then(lambda results: (results, 0.0))
