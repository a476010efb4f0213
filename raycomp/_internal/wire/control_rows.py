"""The two layouts of control row that ride inside gradient collectives, with named fields.

A rank's control row is a few fp32 floats summed across ranks in a reduction every rank
issues anyway (:class:`raycomp._internal.reduce.signals.StepSignals`: one-hot by rank, so the sum is an
all-gather). Position 0 is always the rank's non-finite flag, which the reducer fills in at
the reduction; the caller stages the rest (:meth:`staged`). The layout is part of that
collective: every rank stages the same width, in the same order, each time it stages one.
A field that may be absent is a float with a sentinel on the wire (a 0/1 flag beside the
loss; -1 for the worst compression error), and None here.

* :class:`GuardRow`: per step, for :class:`raycomp._internal.train.step_judge.StepJudge`.
* :class:`SyncRow`: per sync of local steps, from :class:`raycomp._internal.train.local_strategy.LocalStepsStrategy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["GuardRow", "SyncRow"]


def _unpack(row: Sequence[float], width: int, layout: str) -> list[float]:
    """``row`` as a list of ``width`` floats; a row of another width is a different layout."""
    values = [float(v) for v in row]
    if len(values) != width:
        raise ValueError(f"{layout}: a row of {width} floats expected, got {len(values)}")
    return values


@dataclass(frozen=True)
class GuardRow:
    """One rank's row for the per-step guard: the flag of *this* step, the rest of the
    previous one (they are known only after its collectives). On the wire:
    ``[non-finite, loss, has loss, worst error (-1: none), plan offer (0: none)]``."""

    nonfinite: bool = False  #: this rank's compressed gradients held NaN/Inf (set by the reducer)
    loss: float | None = None  #: the previous step's loss; None: skipped, not judged
    worst_error: float | None = None  #: the previous step's worst compression error; None: not measured
    plan_offer: int = 0  #: the version of a plan rank 0 holds and has not announced (0: none)

    WIDTH: ClassVar[int] = 5

    def to_row(self) -> list[float]:
        return [float(self.nonfinite), 0.0 if self.loss is None else self.loss, float(self.loss is not None),
                -1.0 if self.worst_error is None else self.worst_error, float(self.plan_offer)]

    def staged(self) -> list[float]:
        """What the caller stages: the row without the flag, which the reducer fills in."""
        return self.to_row()[1:]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> GuardRow:
        nonfinite, loss, has_loss, worst, offer = _unpack(row, cls.WIDTH, "GuardRow")
        return cls(nonfinite > 0, loss if has_loss > 0 else None, worst if worst >= 0 else None, int(offer))

    @classmethod
    def from_staged(cls, values: Sequence[float]) -> GuardRow:
        """The inverse of :meth:`staged` (a checkpoint's carry), flag clear."""
        return cls.from_row([0.0, *values])


@dataclass(frozen=True)
class SyncRow:
    """One rank's row for a sync of local steps. On the wire:
    ``[non-finite, mean loss since the previous sync, has loss]``."""

    #: this rank's compressed pseudo-gradients held NaN/Inf (set by the reducer), or the mean
    #: did (set on every rank's row: :meth:`raycomp._internal.train.local_strategy.LocalStepsStrategy.after_optimizer_step`)
    nonfinite: bool = False
    mean_loss: float | None = None  #: this rank's mean loss since the previous sync; None: no step applied

    WIDTH: ClassVar[int] = 3

    def to_row(self) -> list[float]:
        return [float(self.nonfinite), 0.0 if self.mean_loss is None else self.mean_loss,
                float(self.mean_loss is not None)]

    def staged(self) -> list[float]:
        """What the caller stages: the row without the flag, which the reducer fills in."""
        return self.to_row()[1:]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> SyncRow:
        nonfinite, mean_loss, has_loss = _unpack(row, cls.WIDTH, "SyncRow")
        return cls(nonfinite > 0, mean_loss if has_loss > 0 else None)
