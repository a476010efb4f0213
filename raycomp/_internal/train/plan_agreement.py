"""The collectives that keep every rank on the same plan: a broadcast of rank 0's plan, and
at each agreement one all-gather that proves the ranks hold the same plan and guard state,
hands out rank 0's offer and carries what dense steps left out of their own collectives
(their losses, for the guard). When to call them, and what they hand over:
:class:`raycomp._internal.train.plan_handoff.PlanHandoff`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from raycomp.plan import Plan

__all__ = ["Agreed", "PlanAgreement", "PlanMismatchError"]


class Agreed(NamedTuple):
    """What an agreement hands every rank alike."""

    plan: Plan | None  #: rank 0's offer (None: none)
    late: list[float]  #: each late value's mean over the ranks, in the order given
    #: the largest ``notice`` any rank gave (the nodes of a preemption notice it holds)
    notice: float = 0.0


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans (or guard states): continuing would desynchronise them."""


class PlanAgreement:
    """Args:
        group: the process group of control messages (gloo; None: the default group).
        late_slots: how many values of each rank an agreement carries beside its check
            (:meth:`agree`'s ``late``; the guard's loss window), the same on every rank.
    """

    def __init__(self, rank: int, world_size: int, group: Any, late_slots: int = 0) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.late_slots = late_slots

    def broadcast(self, plan: Plan | None) -> Plan | None:
        """Rank 0's ``plan`` (or None) on every rank."""
        if self.world_size == 1:
            return plan
        data = plan.to_json().encode() if self.rank == 0 and plan is not None else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        return self._receive(data, int(size))

    def agree(self, installed: Plan, guard_state: tuple[float, ...], offer: Plan | None, step: int,
              late: Sequence[float] = (), notice: float = 0.0) -> Agreed:
        """Prove agreement, then hand out rank 0's ``offer`` (or None).

        One all-gather carries every rank's guard state (skipped steps, fallback active,
        events, ...; include ``len(late)``) and the digest of its installed plan, rank 0's
        offer size, and ``late``: this rank's values that rode in no collective (at most
        ``late_slots``), averaged over the ranks slot by slot, and ``notice``, of which the
        largest over the ranks comes back (a value a rank may hold before the others do). A broadcast of the offer's
        JSON follows only when there is one. Raises :class:`PlanMismatchError` unless all
        rows agree. The offer then needs no check of its own: every rank installs it from
        the same bytes, on the same (verified) guard state, before any gradient moves under it.
        """
        if len(late) > self.late_slots:
            raise ValueError(f"late: at most {self.late_slots} values (late_slots), got {len(late)}")
        data = offer.to_json().encode() if self.rank == 0 and offer is not None else b""
        digest = installed.digest()  # 63 bits: two exact float64 halves
        slots = [*map(float, late), *[0.0] * (self.late_slots - len(late))]  # one width on every rank
        row = torch.tensor([*slots, *guard_state, float(digest >> 32), float(digest & 0xFFFFFFFF),
                            float(installed.version), float(notice), float(len(data))], dtype=torch.float64)
        rows = [row]
        if self.world_size > 1:
            rows = [torch.empty_like(row) for _ in range(self.world_size)]
            dist.all_gather(rows, row, group=self.group)
        table = [r.tolist()[self.late_slots:] for r in rows]
        n = len(guard_state)
        if len({tuple(r[:n]) for r in table}) > 1:
            raise PlanMismatchError(
                f"ranks' guards disagree at step {step} (skipped steps, fallback active, events): "
                + ", ".join(f"rank {i}: {r[:n]}" for i, r in enumerate(table)))
        if len({tuple(r[n:n + 2]) for r in table}) > 1:
            raise PlanMismatchError(
                f"ranks disagree on the plan installed for step {step}: "
                + ", ".join(f"rank {i}: version {int(r[n + 2])}" for i, r in enumerate(table))
                + "; refusing to communicate under different plans")
        means = [math.fsum(r[i].item() for r in rows) / len(rows) for i in range(len(late))]
        return Agreed(self._receive(data, int(table[0][-1])) if self.world_size > 1 else offer, means,
                      max(r[-2] for r in table))

    def _receive(self, data: bytes, size: int) -> Plan | None:
        if size == 0:
            return None
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.group)
        return Plan.from_json(bytes(buffer.tolist()).decode())
