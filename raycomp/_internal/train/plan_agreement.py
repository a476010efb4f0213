"""Every rank on the same plan: rank 0 asks the controller (never blocking) and checks for
the answer every step; its version rides to every rank inside the next step's gradient
collective, and a broadcast then hands the plan to every rank, in force from the step after
(:meth:`raycomp._internal.train.loop.TrainLoop.after_optimizer_step`). At each control boundary, or
a few steps after it (:attr:`~raycomp._internal.train.loop.TrainLoop.agree_after`), one all-gather
proves the ranks agree, hands out an answer not announced yet and carries what dense steps
left out of their own collectives (their losses, for the guard)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from raycomp._internal.train.reporter import Outages
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
        controller: the controller actor handle (None: train on the initial plan).
        group: the process group of control messages (gloo; None: the default group).
        late_slots: how many values of each rank an agreement carries beside its check
            (:meth:`agree`'s ``late``; the guard's loss window), the same on every rank.
    """

    def __init__(self, rank: int, world_size: int, group: Any, controller: Any, run_id: str,
                 outages: Outages, late_slots: int = 0) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.late_slots = late_slots
        self.controller, self.run_id, self.outages = controller, run_id, outages
        self._poll: tuple[Any, Any] | None = None  # the long poll in flight: (ObjectRef, its future)
        self.ready: Plan | None = None  # rank 0: a newer plan than installed, not yet handed out

    def register(self, layers: dict[str, list[int]], options: Any, eval_kind: str, per_node: int = 1,
                 node_link: float | None = None) -> Plan:
        """Rank 0 registers the run (idempotent: a restarted run keeps its controller state);
        every rank gets the controller's current plan. ``per_node``: the ranks of a node of a
        two-level run, 1 when flat; ``node_link``: seconds per byte of an all-reduce inside
        rank 0's node (:mod:`raycomp._internal.node_link`), None when not timed."""
        import ray

        plan = None
        if self.rank == 0 and self.controller is not None:
            c = options.compression
            try:
                plan = Plan.from_dict(ray.get(self.controller.register_run.remote(
                    self.run_id, self.world_size, layers, c.policy, c.policy_options(), c.warmup_steps,
                    options.controller.interval_steps, c.min_compress_numel, eval_kind, per_node,
                    node_link), timeout=60))
            except Exception as error:  # noqa: BLE001 - the controller is optional
                self.outages.add(error, 0)
        fallback = Plan(reason="warm-up: dense" if self.controller is not None else "no controller: dense")
        return self.broadcast(plan or fallback) or fallback

    def check(self, known_version: int) -> None:
        """Rank 0, every step: take the long poll's answer if it is in (never waiting for
        it; :attr:`ready` then holds a plan newer than ``known_version``), and keep one poll
        in flight."""
        if self.controller is None or self.rank != 0:
            return
        if self._poll is not None:
            if not self._poll[1].done():
                return  # still in flight: never wait for it
            try:
                answer = self._poll[1].result()
                plan = None if answer is None else Plan.from_dict(answer)
                if plan is not None and plan.version > max(known_version, self.ready_version):
                    self.ready = plan
            except Exception as error:  # noqa: BLE001
                self.outages.add(error, known_version)
            self._poll = None
        try:
            # a long poll: answers as soon as a plan newer than the newest known exists. Its
            # future is set by Ray's own thread when the answer arrives, so the check above
            # reads a flag: ``ray.wait(timeout=0)`` cost 0.5 ms a step on a 50-ms CNN step
            ref = self.controller.plan.remote(self.run_id, max(known_version, self.ready_version), 30.0)
            self._poll = (ref, ref.future())
        except Exception as error:  # noqa: BLE001
            self.outages.add(error, known_version)

    @property
    def ready_version(self) -> int:
        """Rank 0: the version of the plan it holds and has not handed out (0: none)."""
        return 0 if self.ready is None else self.ready.version

    def take(self) -> Plan | None:
        """Rank 0: the ready plan, handed out once."""
        plan, self.ready = self.ready, None
        return plan

    def poll(self, known_version: int) -> Plan | None:
        """Rank 0 at a boundary: the ready plan, if any (after a :meth:`check`)."""
        self.check(known_version)
        return self.take()

    def broadcast(self, plan: Plan | None) -> Plan | None:
        """Rank 0's ``plan`` (or None) on every rank (at registration)."""
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
