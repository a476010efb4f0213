"""Which parameters form each fragment, and at which inner step each fragment syncs.

Both are pure functions of what every rank holds identically (the parameters' names and
shapes, ``sync_every``, ``fragments``, the step count), so every rank issues the same
collectives at the same step without agreeing on anything at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FragmentSchedule", "resolve_delay", "split_fragments"]


def split_fragments(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of consecutive parameters, cut into ``fragments`` runs of about equal size.

    Consecutive runs keep a fragment to whole layers in model order (Streaming DiLoCo syncs
    blocks of layers); cutting at the running total's multiples of ``total / fragments``
    balances the bytes each sync sends. Every fragment gets at least one parameter.
    """
    if fragments < 1 or fragments > len(numels):
        raise ValueError(f"fragments: must be between 1 and the number of parameters ({len(numels)}), "
                         f"got {fragments}")
    total = sum(numels)
    runs: list[list[int]] = [[]]
    seen = 0
    for i, n in enumerate(numels):
        unopened = fragments - len(runs)
        full = seen >= len(runs) * total / fragments
        if runs[-1] and unopened and (full or len(numels) - i <= unopened):
            runs.append([])
        runs[-1].append(i)
        seen += n
    return runs


def resolve_delay(delay: int | str, sync_every: int, fragments: int = 1) -> int:
    """The inner steps a sync stays on the wire under ``sync_every`` and ``fragments``.

    ``"auto"`` is one step wherever the fragments' syncs are at least two steps apart, else
    0 (Streaming DiLoCo overlaps a sync with the next inner steps so that it need not stall
    training; one step already hides most of a sync on a slow link). A number is capped below the spacing, since an H
    chosen at run time may be smaller than the one it was set for. Every rank resolves it
    from the same numbers, so all hold the same schedule.
    """
    wanted = 1 if delay == "auto" else int(delay)
    return max(0, min(wanted, sync_every // fragments - 1))


@dataclass(frozen=True)
class FragmentSchedule:
    """Fragment ``f`` syncs after inner steps ``s`` with ``s % sync_every == offset(f)``.

    With one fragment that is every ``sync_every`` steps (DiLoCo). With F fragments each
    still syncs once every ``sync_every`` steps, staggered by ``sync_every / F`` (Streaming
    DiLoCo), so a sync carries 1/F of the model and the link is busy F times as often with
    a payload F times smaller. ``delay`` inner steps run while a sync is on the wire (0: the
    sync completes before the next inner step); it must end before the next fragment's
    starts.
    """

    sync_every: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every: must be an integer >= 1, got {self.sync_every!r}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) \
                or not 1 <= self.fragments <= self.sync_every:
            raise ValueError(f"fragments: must be an integer from 1 to sync_every ({self.sync_every}), "
                             f"got {self.fragments!r}")
        spacing = self.sync_every // self.fragments
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or not 0 <= self.delay < spacing:
            raise ValueError(f"delay: must be an integer from 0 to sync_every // fragments - 1 ({spacing - 1}), "
                             f"got {self.delay!r}")

    def offset(self, fragment: int) -> int:
        """The residue of ``step % sync_every`` at which ``fragment`` starts its sync."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def due(self, step: int) -> list[int]:
        """The fragments whose sync starts after inner step ``step`` (1-based count)."""
        if step < 1:
            return []
        return [f for f in range(self.fragments) if step % self.sync_every == self.offset(f)]
