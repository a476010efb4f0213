"""Collectives in flight: the process group they travel on and the handle that waits for them.

Every transport issues its collectives from the caller's thread, in the caller's order, and
returns a :class:`Pending` whose *last* collective may still be on the wire; whoever calls
:meth:`Pending.wait` (possibly another thread) waits for it and finishes the decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Group", "Pending"]

T = TypeVar("T")
U = TypeVar("U")


class Pending(Generic[T]):
    """A reduction whose last collective is in flight.

    :meth:`wait` waits for that collective (``works``) and then runs ``finish``, which
    reads its output: decoding, averaging. Call it once. Nothing in ``finish`` issues a
    collective, so it may run on another thread than the one that issued the work.
    """

    def __init__(self, works: Sequence[dist.Work], finish: Callable[[], T]) -> None:
        self.works = list(works)
        self.finish = finish

    @classmethod
    def done(cls, value: T) -> Pending[T]:
        """A result with nothing in flight (one process, or nothing to send)."""
        return cls([], lambda: value)

    def then(self, step: Callable[[T], U]) -> Pending[U]:
        """The same collective in flight, with ``step`` applied to what it finishes with."""
        return Pending(self.works, lambda: step(self.finish()))

    def wait(self) -> T:
        for work in self.works:
            work.wait()
        return self.finish()


@dataclass
class Group:
    """A process group with its size and this rank's index (``None`` = default group)."""

    handle: dist.ProcessGroup | None = None
    #: (size, rank), read once the process group exists: a group never changes either, and
    #: asking torch costs microseconds that the hook paid several times per layer and step
    _shape: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self._read()[0]

    @property
    def rank(self) -> int:
        return self._read()[1]

    def _read(self) -> tuple[int, int]:
        if self._shape is None:
            if not dist.is_initialized():
                return 1, 0  # not cached: the group may be created later
            self._shape = (dist.get_world_size(self.handle), dist.get_rank(self.handle))
        return self._shape

    def allreduce_bytes(self, nbytes: int) -> float:
        w = self.size
        return 2 * (w - 1) / w * nbytes

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        for work in self.start_all_reduce(tensor):
            work.wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out, works = self.start_all_gather(tensor)
        for work in works:
            work.wait()
        return out

    def start_all_reduce(self, tensor: torch.Tensor) -> list[dist.Work]:
        """Issue a sum all-reduce of ``tensor`` in place; its work (none: nothing to do)."""
        if self.size > 1 and tensor.numel():
            return [dist.all_reduce(tensor, group=self.handle, async_op=True)]
        return []

    def start_all_gather(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Issue an all-gather: the output tensors (filled once the work is done), the work."""
        if self.size == 1:
            return [tensor], []
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        return out, [dist.all_gather(out, tensor, group=self.handle, async_op=True)]
