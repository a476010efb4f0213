"""Tensors in one buffer, as the transports send them: grouping by dtype, splitting,
chunking, a view of tensors lying back to back, and every rank's packed payloads through one
all-gather.

The order of every collective built here depends only on the order, shapes and dtypes of
the tensors given, so it is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raycomp._internal.transports.work import Group, Pending
from raycomp._internal.wire.payload import Payload, pack, unpack_like
from raycomp.compressors import Compressor

__all__ = ["buffer_view", "by_dtype", "chunk_sizes", "chunks", "gather_payloads", "split", "to_device"]


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance.

    One collective per group, issued in this order: it depends only on the order and dtypes
    of the tensors, so it is the same on every rank. (Iterating a ``set`` of dtypes is not:
    dtype hashes differ between processes, and ranks would then all-reduce different
    buffers against each other.)
    """
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def split(buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` shaped like ``like``, back to back."""
    out, offset = [], 0
    for t in like:
        out.append(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """The sizes of :func:`chunks`: near-equal, the first ones one larger."""
    base, extra = divmod(numel, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def chunks(buffer: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` contiguous near-equal pieces (sizes differ by at most one)."""
    return list(buffer.split(chunk_sizes(buffer.numel(), parts)))


def buffer_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view of the storage that holds ``tensors`` back to back, in order and
    contiguous (a DDP bucket's gradients, or their means split from one buffer); None if
    they do not lie so."""
    if not tensors:
        return None
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != end
                or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (control floats) on ``device`` without a device-to-host wait: on CUDA
    through pinned memory, asynchronously, ordered on the current stream."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def gather_payloads(
    payloads: Sequence[Payload], compressors: Sequence[Compressor], group: Group
) -> tuple[Pending[list[list[Payload]]], float]:
    """Every rank's payloads, in rank order, through one all-gather of packed bytes.

    If any payload can vary in size, every rank first all-gathers the element counts of
    its payload tensors (waited for here), so all ranks know every peer's layout and the
    padded length. Returns the all-gather in flight, which finishes with the payloads per
    rank, and the overhead bytes (counts, padding).
    """
    w = group.size
    overhead = 0.0
    if any(c.variable_size for c in compressors):
        counts = torch.tensor(
            [t.numel() for p in payloads for t in p.tensors.values()], dtype=torch.int64,
            device=next(iter(payloads[0].tensors.values())).device,  # NCCL has no CPU tensors
        )
        peer_counts = torch.stack(group.all_gather(counts)).tolist()  # one device-to-host wait
        overhead += (w - 1) * counts.numel() * counts.element_size()
        layouts = [_layout_with_counts(payloads, pc) for pc in peer_counts]
    else:
        layouts = [list(payloads)] * w
    sizes = [sum(p.nbytes for p in layout) for layout in layouts]
    padded = max(1, max(sizes))  # never an empty buffer
    own = pack(payloads)
    buffer = own
    if own.numel() != padded:  # a peer's payload is larger (or all are empty): pad with zeros
        buffer = torch.zeros(padded, dtype=torch.uint8, device=own.device)
        buffer[: own.numel()] = own
    gathered, works = group.start_all_gather(buffer)
    overhead += (w - 1) * (padded - own.numel())

    def unpack() -> list[list[Payload]]:
        return [
            unpack_like(buf[:size], layout)
            for buf, size, layout in zip(gathered, sizes, layouts, strict=True)
        ]

    return Pending(works, unpack), overhead


def _layout_with_counts(templates: Sequence[Payload], counts: Sequence[int]) -> list[Payload]:
    it = iter(counts)
    return [
        p.with_tensors({n: t.new_empty(next(it)) for n, t in p.tensors.items()}) for p in templates
    ]
