"""The dense transport: the gradients themselves, all-reduced (one collective per dtype)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from raycomp._internal.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.packing import buffer_view, by_dtype, split
from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Transport

__all__ = ["DenseAllreduce", "dense_allreduce", "mean_in_place"]


def dense_allreduce(
    tensors: Sequence[torch.Tensor], group: Group, *, control: torch.Tensor | None = None,
    in_place: bool = False,
) -> Pending[list[Reduced]]:
    """Plain all-reduce mean; divides before summing, as DDP does, so results match it.

    ``control`` (optional, 1-D): a few floats that ride along and are *summed* over ranks in
    place — appended, after the division, to the collective of its dtype, or all-reduced on
    their own if no tensor has that dtype. The gradients' values are unaffected by it.
    ``in_place``: the inputs may be overwritten; tensors that already lie back to back (a
    DDP bucket's gradients) are then reduced where they are, without a flattening copy,
    and the others' means are copied back into them (small layers between a bucket's
    compressed ones: the bucket then holds every mean, and the hook hands it back whole).
    """
    works: list[dist.Work] = []
    joined: list[tuple[list[int], torch.Tensor]] = []
    carried: tuple[torch.Tensor, torch.Tensor] | None = None  # (control, the buffer it rides in)
    for members in by_dtype(tensors):
        lying = buffer_view([tensors[i] for i in members]) if in_place else None
        parts = [lying] if lying is not None else [tensors[i].reshape(-1) for i in members]
        sent, started, rode = _divide_and_send(parts, group, control, in_place=lying is not None)
        works += started
        if rode:
            carried, control = (control, sent), None  # type: ignore[assignment]
        joined.append((members, sent))
    if control is not None:  # no tensor of its dtype: a collective of its own
        works += group.start_all_reduce(control)

    def finish() -> list[Reduced]:
        if carried is not None:
            carried[0].copy_(carried[1][-carried[0].numel():])
        out: list[Reduced | None] = [None] * len(tensors)
        for members, buffer in joined:
            for i, mean in zip(members, split(buffer, [tensors[i] for i in members]), strict=True):
                t = tensors[i]
                if in_place and mean.data_ptr() != t.data_ptr():
                    mean = t.copy_(mean)  # reduced in a copy (not back to back): back where it lies
                out[i] = Reduced(mean, t, group.allreduce_bytes(t.numel() * t.element_size()))
        return out  # type: ignore[return-value]

    return Pending(works, finish)


def _divide_and_send(parts: Sequence[torch.Tensor], group: Group, control: torch.Tensor | None, *,
                     in_place: bool) -> tuple[torch.Tensor, list[dist.Work], bool]:
    """Issue the sum all-reduce of the 1-D ``parts`` back to back, divided by the group's
    size (before the sum, as DDP does), with ``control`` appended where it has their dtype
    and device: (the buffer sent, its work, whether ``control`` rode in it). One part that
    may be overwritten (``in_place``) and carries nothing is divided and sent where it lies;
    otherwise the parts and ``control`` are copied once, into one new buffer."""
    first = parts[0]
    rides = control is not None and control.dtype == first.dtype and control.device == first.device
    if in_place and len(parts) == 1 and not rides:
        buffer = first.div_(group.size)
    else:
        buffer = torch.cat([*parts, control] if rides else list(parts))  # type: ignore[list-item]
        buffer[:sum(p.numel() for p in parts)].div_(group.size)
    return buffer, group.start_all_reduce(buffer), rides


def mean_in_place(parts: Sequence[torch.Tensor], group: Group,
                  control: torch.Tensor | None = None) -> torch.futures.Future:
    """:func:`dense_allreduce` of 1-D ``parts`` back to back that may be overwritten (a DDP
    bucket's buffer, or the gradients of a whole step), as a future of the mean: the one part
    itself, reduced where it lies, or the front of the one buffer the parts (and ``control``,
    where it rides along: same dtype and device) were copied into; ``control`` holds its sum
    once the future is done. The same division, collectives and results, with less Python
    on the hot path: no per-tensor results, and a callback of a few lines on the
    collective's thread, as torch's all-reduce hook has."""
    buffer, works, carried = _divide_and_send(parts, group, control, in_place=True)
    if control is not None and not carried:  # no tensor of its dtype: a collective of its own
        works += group.start_all_reduce(control)
    futures = [work.get_future() for work in works]
    n = sum(p.numel() for p in parts)

    def mean(_: torch.futures.Future | None = None) -> torch.Tensor:
        for future in futures:
            future.value()  # a failed collective raises here
        if carried:
            control.copy_(buffer[n:])  # type: ignore[union-attr]
        return buffer if buffer.numel() == n else buffer[:n]

    if not futures:  # one process: nothing in flight
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(mean())
        return done
    return (futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)).then(mean)


class DenseAllreduce(Communicator):
    """:func:`dense_allreduce`, in place where every tensor of the batch may be overwritten."""

    kind = Transport.DENSE
    carries_control = True

    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        pending = dense_allreduce(batch.tensors, group, control=batch.control, in_place=all(batch.overwritable))
        return pending.then(lambda results: (results, 0.0))
