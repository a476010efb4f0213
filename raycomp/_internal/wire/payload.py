"""What travels on the wire: a compressed tensor and its exact size in bytes.

A :class:`Payload` holds only the tensors that are actually transmitted, plus the
metadata every rank can reconstruct locally (shape, dtype) and therefore never
sends. ``payload.nbytes`` is the exact number of bytes of the transmitted tensors.

Payloads of fixed structure are packed into one ``uint8`` buffer to travel in a
single collective (all-to-all, all-gather) together with payloads of other layers;
:func:`pack` / :func:`unpack_like` do that without copying more than once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Payload", "pack", "unpack_like"]


@dataclass
class Payload:
    """A compressed tensor: the wire tensors and the local metadata to rebuild it.

    Attributes:
        tensors: name -> tensor; exactly what is put on the wire.
        shape: shape of the original tensor (known to every rank, not transmitted).
        dtype: dtype of the original tensor (not transmitted).
    """

    tensors: dict[str, torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact number of bytes of the transmitted tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def dense_nbytes(self) -> int:
        """Bytes the uncompressed tensor would occupy."""
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    def with_tensors(self, tensors: Mapping[str, torch.Tensor]) -> Payload:
        """The same payload structure carrying other wire tensors (e.g. a peer's)."""
        return Payload(dict(tensors), self.shape, self.dtype, dict(self.meta))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(payloads: Sequence[Payload], device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate the wire tensors of ``payloads`` into one uint8 buffer.

    The buffer lives on the payloads' device. When they hold no bytes at all it is empty,
    on ``device`` if given, else on the device of their first (empty) tensor, else the CPU:
    never a CPU tensor next to CUDA peers (``torch.cat`` of buffers would fail).
    """
    parts = [_as_bytes(t) for p in payloads for t in p.tensors.values() if t.numel()]
    if not parts:
        if device is None:
            device = next((t.device for p in payloads for t in p.tensors.values()), "cpu")
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack_like(buffer: torch.Tensor, templates: Sequence[Payload]) -> list[Payload]:
    """Split ``buffer`` (made by :func:`pack` on a peer) using local payloads as layout.

    Each template must have the same tensor names, dtypes and shapes as the peer's
    payload at that position; for fixed-size compressors a local payload of a tensor of
    the same shape is such a template.
    """
    expected = sum(t.numel() * t.element_size() for p in templates for t in p.tensors.values())
    if expected != buffer.numel():  # checked first: a short buffer would fail in view()
        raise ValueError(
            f"payload buffer holds {buffer.numel()} bytes but the layout describes {expected}; "
            "ranks disagree on what is being sent"
        )
    out: list[Payload] = []
    offset = 0
    for template in templates:
        tensors: dict[str, torch.Tensor] = {}
        for name, t in template.tensors.items():
            nbytes = t.numel() * t.element_size()
            chunk = buffer[offset : offset + nbytes]
            if chunk.storage_offset() % t.element_size():
                chunk = chunk.clone()  # viewing bytes as a wider dtype needs an aligned start
            tensors[name] = chunk.view(t.dtype).reshape(t.shape) if nbytes else t.new_empty(t.shape)
            offset += nbytes
        out.append(template.with_tensors(tensors))
    return out
