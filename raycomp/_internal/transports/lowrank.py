"""The low-rank transport: PowerSGD's two all-reduces (every P, then every Q) per batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raycomp._internal.transports.base import Batch, Communicator, Delivered, Reduced
from raycomp._internal.transports.packing import split
from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Transport
from raycomp.compressors.powersgd import PowerSGD

__all__ = ["LowRankAllreduce", "lowrank_allreduce"]


def lowrank_allreduce(
    tensors: Sequence[torch.Tensor], compressors: Sequence[PowerSGD], group: Group
) -> Pending[list[Reduced]]:
    """PowerSGD's two rounds for all layers at once: all-reduce every P, orthogonalise,
    all-reduce every Q (two collectives per bucket, like torch's ``powerSGD_hook``). The
    P round is waited for here; the Q round is the one in flight."""
    w = group.size
    matrices = [
        t.detach().float().reshape(c.matrix_shape(t.shape))
        for t, c in zip(tensors, compressors, strict=True)
    ]
    ps = [c.project(m) for c, m in zip(compressors, matrices, strict=True)]
    p_flat = group.all_reduce_(torch.cat([p.reshape(-1) for p in ps])).div_(w)
    p_hats = [
        c.orthogonalize(p.reshape(ref.shape).clone())
        for c, p, ref in zip(compressors, split(p_flat, ps), ps, strict=True)
    ]
    qs = [c.back_project(m, p) for c, m, p in zip(compressors, matrices, p_hats, strict=True)]
    sent = [(p @ q.T).reshape(t.shape).to(t.dtype) for p, q, t in zip(p_hats, qs, tensors, strict=True)]
    q_flat = torch.cat([q.reshape(-1) for q in qs])
    works = group.start_all_reduce(q_flat)

    def finish() -> list[Reduced]:
        q_flat.div_(w)
        results = []
        for c, p, q, s, t in zip(compressors, p_hats, split(q_flat, qs), sent, tensors, strict=True):
            c.remember(q)
            wire = group.allreduce_bytes((p.numel() + q.numel()) * 4)
            results.append(Reduced((p @ q.T).reshape(t.shape).to(t.dtype), s, wire))
        return results

    return Pending(works, finish)


class LowRankAllreduce(Communicator):
    """:func:`lowrank_allreduce` for a batch (no overhead bytes)."""

    kind = Transport.LOWRANK

    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        pending = lowrank_allreduce(batch.tensors, batch.compressors, group)  # type: ignore[arg-type]
        return pending.then(lambda results: (results, 0.0))
