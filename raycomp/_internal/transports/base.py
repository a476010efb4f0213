"""The one interface every transport implements, and what it hands back per layer.

A transport (:class:`Communicator`) takes the layers of one reduction that share a
:class:`~raycomp.compressors.Transport` kind — a :class:`Batch` — compresses them, issues
its collectives, and returns a :class:`~raycomp._internal.transports.work.Pending` that finishes with
one :class:`Reduced` per layer (the mean over ranks, what *this* rank contributed, for
error feedback, and the bytes this rank put on the wire for it) and the batch's overhead
bytes.

Wire bytes are what this rank *transmits* under the bandwidth-optimal algorithm of each
collective (what a NIC counter sees, framing aside), with ``W`` ranks:

* all-reduce of ``B`` bytes (ring: reduce-scatter + all-gather): ``2 (W - 1) / W * B``
* all-gather of ``B`` bytes from each rank: ``(W - 1) * B``
* all-to-all: the bytes addressed to the other ``W - 1`` ranks

The dense-equivalent of a layer is the all-reduce of its uncompressed gradient. Bytes of
size headers and padding are charged to the pseudo-layer :data:`OVERHEAD`.

No collective is ever given an empty tensor (gloo rejects them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from raycomp._internal.transports.work import Group, Pending
from raycomp.compressors import Compressor, Transport

__all__ = ["OVERHEAD", "Batch", "Communicator", "Delivered", "Reduced"]

OVERHEAD = "(overhead)"


@dataclass
class Reduced:
    mean: torch.Tensor  # the mean over ranks of what was sent, shaped like the input
    sent: torch.Tensor  # this rank's own contribution, decompressed
    wire_bytes: float  # bytes this rank transmitted for this layer


#: What a transport finishes with: one :class:`Reduced` per layer, and the overhead bytes.
Delivered = tuple[list[Reduced], float]


@dataclass
class Batch:
    """The layers of one reduction that travel by one transport, in the caller's order.

    ``tensors`` are the compensated gradients; ``overwritable[i]``: tensor ``i`` is the
    caller's own and may be overwritten (a DDP bucket's gradient, outside statistics
    steps). ``control``: a few fp32 floats summed over ranks, riding with this batch.
    ``keep_sent``: every layer's :attr:`Reduced.sent` must be what it contributed,
    decompressed (statistics steps read it). Otherwise a transport may hand back the input
    itself for a compressor without error feedback, as the dense transport always does:
    nothing is kept for it, and decoding its own contribution would cost two passes over
    the layer for nothing.
    """

    names: list[str]
    tensors: list[torch.Tensor]
    compressors: list[Compressor]
    overwritable: list[bool]
    control: torch.Tensor | None = None
    keep_sent: bool = True

    def select(self, members: Sequence[int], control: torch.Tensor | None) -> Batch:
        """The layers at ``members``, carrying ``control``."""
        return Batch([self.names[i] for i in members], [self.tensors[i] for i in members],
                     [self.compressors[i] for i in members], [self.overwritable[i] for i in members],
                     control, self.keep_sent)


class Communicator(ABC):
    """One transport: compress a batch, issue its collectives, decode when they are done.

    Subclasses name the :class:`~raycomp.compressors.Transport` they carry (``kind``) and
    implement :meth:`start`. One that keeps state across steps (the scalable transport's
    server-side residuals) overrides the state hooks and names its checkpoint entry
    (``state_key``).
    """

    kind: ClassVar[Transport]
    #: the key of this transport's state in the reducer's checkpoint (None: it holds none)
    state_key: ClassVar[str | None] = None
    #: whether :attr:`Batch.control` may ride with this transport's collective
    carries_control: ClassVar[bool] = False

    @abstractmethod
    def start(self, batch: Batch, group: Group) -> Pending[Delivered]:
        """Compress ``batch`` and issue its collectives; the last one stays in flight."""

    # optional hooks, no-ops for a transport without state (hence not abstract)
    def reset(self) -> None:  # noqa: B027
        """Forget state kept across steps (a step the optimizer skipped)."""

    def rescale(self, factor: torch.Tensor) -> None:  # noqa: B027
        """The gradients' units changed by ``factor`` (a loss scaler's new scale)."""

    def state_dict(self) -> Any:
        return {}

    def load_state_dict(self, state: Any) -> None:  # noqa: B027
        pass
