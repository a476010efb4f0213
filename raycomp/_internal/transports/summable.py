"""The summable transport: payloads that add up element-wise (casts, shared-index Random-K),
one all-reduce per dtype."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from raycomp._internal.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.packing import buffer_view, by_dtype, split
from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Compressor, Transport
from raycomp.compressors.casts import Cast

__all__ = ["SummableAllreduce", "summable_allreduce"]


def summable_allreduce(
    tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor], group: Group, *, keep_sent: bool = True,
    in_place: bool = False,
) -> Pending[list[Reduced]]:
    """Payloads that add up element-wise (casts, shared-index Random-K): one all-reduce.

    Inputs are divided by the world size before compression so the sum is the mean and a
    half-precision sum cannot overflow (as torch's ``fp16_compress_hook``). ``keep_sent``:
    as :attr:`~raycomp._internal.transports.base.Batch.keep_sent`. ``in_place``: the inputs may be
    overwritten; casts are then decoded into them (a DDP bucket's gradients: the bucket
    then holds the means, and the hook hands it back without a copy).
    """
    if _one_cast(tensors, compressors):
        return _cast_allreduce(tensors, compressors[0], group, keep_sent, in_place)  # type: ignore[arg-type]
    w = group.size
    payloads = [c.compress(t / w) for t, c in zip(tensors, compressors, strict=True)]
    sent = [c.decompress(p) * w if keep_sent or c.error_feedback else t
            for t, p, c in zip(tensors, payloads, compressors, strict=True)]
    wire_tensors = [t for p in payloads for t in p.tensors.values()]
    works: list[dist.Work] = []
    joined: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    for indices in by_dtype(wire_tensors):
        members = [wire_tensors[i] for i in indices]
        buffer = torch.cat([t.reshape(-1) for t in members])
        works += group.start_all_reduce(buffer)
        joined.append((members, buffer))

    def finish() -> list[Reduced]:
        for members, buffer in joined:
            for t, total in zip(members, split(buffer, members), strict=True):
                t.copy_(total)  # payload tensors now hold the sums
        return [
            Reduced(c.decompress(p), s, group.allreduce_bytes(p.nbytes))
            for p, c, s in zip(payloads, compressors, sent, strict=True)
        ]

    return Pending(works, finish)


def _one_cast(tensors: Sequence[torch.Tensor], compressors: Sequence[Compressor]) -> bool:
    """Whether every layer is cast to one wire dtype from one dtype (a DDP bucket's under a
    bf16 or fp16 plan): then one buffer holds them all, from the division to the decoding.
    Only a plain cast: a subclass that encodes or decodes its own way, or keeps a residual,
    takes the general path."""
    if not tensors or not all(_plain_cast(c) for c in compressors):
        return False
    return len({c.wire_dtype for c in compressors}) == 1 and len({t.dtype for t in tensors}) == 1  # type: ignore[attr-defined]


def _plain_cast(c: Compressor) -> bool:
    kind = type(c)
    return isinstance(c, Cast) and kind._compress is Cast._compress and kind.decompress is Cast.decompress \
        and not c.error_feedback


def _cast_allreduce(tensors: Sequence[torch.Tensor], cast: Cast, group: Group, keep_sent: bool,
                    in_place: bool) -> Pending[list[Reduced]]:
    """:func:`summable_allreduce` of layers all cast alike, with what a cast hook does and no
    more: the layers divided straight into one wire buffer (rounded once, as ``compress(t /
    w)`` rounds), that buffer all-reduced and decoded, into the inputs where they may be
    overwritten (no new full-size buffer, whose pages the allocator would fault in every
    step); one operation each way where the inputs lie back to back. The same values and
    bytes as the general path."""
    w = group.size
    region = buffer_view(tensors)
    wire = torch.empty(sum(t.numel() for t in tensors), dtype=cast.wire_dtype, device=tensors[0].device)
    places = split(wire, tensors)  # each layer's place in the wire buffer
    if region is not None:
        torch.div(region, w, out=wire)
    else:
        for t, place in zip(tensors, places, strict=True):
            torch.div(t, w, out=place)
    sent = [place.to(t.dtype) * w for t, place in zip(tensors, places, strict=True)] \
        if keep_sent else list(tensors)
    works = group.start_all_reduce(wire)

    def finish() -> list[Reduced]:
        means: Sequence[torch.Tensor]
        if in_place:  # the inputs (also what ``sent`` hands back) now hold the means
            if region is not None:
                region.copy_(wire)
            else:
                for t, total in zip(tensors, places, strict=True):
                    t.copy_(total)
            means = tensors
        else:
            means = split(wire.to(tensors[0].dtype), tensors)
        return [Reduced(mean, s, group.allreduce_bytes(t.numel() * wire.element_size()))
                for t, mean, s in zip(tensors, means, sent, strict=True)]

    return Pending(works, finish)


class SummableAllreduce(Communicator):
    """:func:`summable_allreduce` for a batch (no overhead bytes), in place where every
    tensor of the batch may be overwritten."""

    kind = Transport.ALLREDUCE

    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        return summable_allreduce(batch.tensors, batch.compressors, group, keep_sent=batch.keep_sent,
                                  in_place=all(batch.overwritable)).then(lambda results: (results, 0.0))
