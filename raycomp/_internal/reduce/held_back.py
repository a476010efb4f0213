"""Error-feedback updates held back for layers idle on this rank, until it is known whether
any rank used them.

DDP with ``find_unused_parameters`` drops the mean of a layer that no rank used at a step
(:mod:`raycomp._internal.ddp.state`). A lossy layer whose gradient is all zero on this rank
may be such a layer, so its memory update waits: :meth:`HeldBackUpdates.settle` applies it
as sent where some rank used the layer (its mean reached the optimizer), else as if nothing
had been sent (the residual keeps all it held).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from raycomp._internal.reduce.memory import Memory
from raycomp._internal.transports import Reduced
from raycomp.compressors import Compressor

__all__ = ["HeldBackUpdates"]


class HeldBackUpdates:
    """A reducer's memory updates, each applied at once or, for a lossy layer idle on this
    rank while :attr:`enabled`, held back until :meth:`settle`."""

    def __init__(self) -> None:
        #: hold back idle layers' updates (the DDP hook with ``find_unused_parameters``)
        self.enabled = False
        self._held: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}

    @property
    def holding(self) -> bool:
        """Whether some update waits for :meth:`settle`."""
        return bool(self._held)

    def __contains__(self, layer: str) -> bool:
        return layer in self._held

    def used_flags(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Whether each gradient has a nonzero element, as 0-d tensors read later in one
        transfer; [] while not :attr:`enabled`. Taken before an in-place reduction."""
        return [g.any() for g in grads] if self.enabled else []

    def update(self, memory: Memory, names: Sequence[str], compressors: Sequence[Compressor],
               compensated: Sequence[torch.Tensor], reduced: Sequence[Reduced],
               used: Sequence[torch.Tensor]) -> None:
        """Keep what was not sent. A layer sent in full, or by a compressor that takes no
        error feedback, leaves nothing; a lossy layer idle here (``used``: its
        :meth:`used_flags`) waits for :meth:`settle`."""
        idle = _none_true(used) if used else [False] * len(names)
        for i, name in enumerate(names):
            result, compressor = reduced[i], compressors[i]
            lossy = result.sent is not compensated[i] and compressor.error_feedback
            sent = result.sent if lossy else compensated[i]
            if lossy and idle[i]:
                self._held[name] = (compensated[i], sent, compressor.sparse)
            else:
                memory.update(name, compensated[i], sent, compressor.sparse)

    def settle(self, memory: Memory, used: Callable[[str], bool]) -> None:
        """Apply the held-back updates: as sent where ``used(layer)``, else as if nothing
        had been sent."""
        held, self._held = self._held, {}
        for name, (compensated, sent, sparse) in held.items():
            if used(name):
                memory.update(name, compensated, sent, sparse)
            else:
                memory.update(name, compensated, torch.zeros_like(sent), False)

    def clear(self) -> None:
        """Forget the held-back updates (the memory they would update was reset)."""
        self._held.clear()


def _none_true(flags: Sequence[torch.Tensor]) -> list[bool]:
    """``not flag`` for each boolean scalar tensor, read in one host transfer."""
    return (~torch.stack([f.to(flags[0].device) for f in flags])).tolist()
