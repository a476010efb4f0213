"""The per-step guard decision, with no collective of its own.

Every rank decides from what every rank already holds identically after the step's
gradient collectives:

* the reduced (mean) gradient — the same tensor on every rank — whose norm each rank
  computes with the same ops in the same order (NaN/Inf anywhere makes it non-finite);
* the control rows that rode inside the step's last gradient collective
  (:meth:`raycomp._internal.reduce.reducer.CompressedReducer.stage_control`): per rank, its local non-finite
  flag of *this* step, and its loss and worst compression error of the *previous* step
  (:class:`~raycomp._internal.wire.control_rows.GuardRow`).

Trade-off (the loss is only known after backward, when the step's collectives are done):
the loss and the compression error reach the guard one step late. Both only switch to
dense — they never skip a step — so the delay costs at most one more compressed step.
Non-finite gradients and norm explosions, which skip the step, are judged in their own
step. The alternative, a control all-gather per step, costs a collective round a step. Ranks that
nevertheless decided differently are caught at the next control boundary
(:meth:`raycomp._internal.train.plan_agreement.PlanAgreement.agree` compares guard states).

A dense step that DDP's own reduction carries has no collective of raycomp's to ride in.
With ``every_step=False`` (``controller.dense_control: at_boundaries``, the default) its
values are staged skippable while the guard is not in fallback, and such a step goes
without them: its non-finite gradient is still caught on its step (the mean's norm), the
loss it carried (:attr:`StepJudge.left_out`) waits in
:attr:`raycomp._internal.train.plan_handoff.PlanHandoff.late` and is judged at the next
agreement, whose all-gather carries it (:meth:`StepJudge.judge_late`), and rank 0's new plan
is handed out by that agreement too. In fallback every step carries them: recovery is
judged on losses as they come. With ``every_step=True`` the values take a tiny all-reduce of
their own on such a step.

At agreements (not per step) the guard also judges the applied mean's compression error
(:meth:`StepJudge.judge_mean_error`: one all-gather, where the state measures it).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.guard import Guard, GuardEvent, Verdict
from raycomp._internal.reduce.mean_error import layer_errors
from raycomp._internal.wire.control_rows import GuardRow, SyncRow

__all__ = ["StepJudge"]

log = logging.getLogger("raycomp.train")


class StepJudge:
    """Args:
        guard: the state machine (thresholds, hysteresis, events).
        state: the rank's :class:`~raycomp._internal.ddp.hook.CompressionState` or, for a sharded model,
            :class:`~raycomp._internal.fsdp.state.ShardedState` (carries the control rows, knows the
            norm every rank sees).
        group: process group for the fallback exchange when no control rows rode with this
            step's reduction (a gradient strategy that carries none: one small all-reduce).
        grad_scaler: the run's ``torch.amp.GradScaler``, or None. Its overflows are its own
            business: a step whose gradients are not finite while the scale is above 1 is
            skipped (the scaler backs off) without a fallback. At a scale of 1 or below
            the unscaled gradient itself overflows, and the guard falls back as without a
            scaler. Every rank holds the same scale: it follows the same reduced gradient.
        every_step: whether the values ride with every step (True), or may stay home on a
            dense step that would need a collective of their own for them, while the guard
            is not in fallback (False; see the module docstring). The same on every rank.
        layers: the layers a plan can compress, whose applied mean's error
            :meth:`judge_mean_error` judges.
    """

    def __init__(self, guard: Guard, state: Any, rank: int, world_size: int, group: Any = None,
                 grad_scaler: Any = None, every_step: bool = True, layers: Sequence[str] = ()) -> None:
        self.guard, self.state = guard, state
        self.every_step = every_step
        self.rank, self.world_size, self.group = rank, world_size, group
        self.grad_scaler = grad_scaler
        self.overflows = 0  # steps skipped for the loss scaler
        self.layers = list(layers)
        #: what rides in the next step's collective: the previous step's loss, its worst
        #: compression error, and the plan version rank 0 offers (none of them yet)
        self.carry = GuardRow()
        #: read out of this step's rows (:meth:`decide`): the version rank 0 announced, and
        #: this rank's loss that rode in no collective (its values were left out), else None
        self.announced = 0
        self.left_out: float | None = None
        #: this rank's recent gradient norms during local steps (its own, not agreed on)
        self.inner_norms: deque[float] = deque(maxlen=guard.grad_norms.maxlen)
        self._errors_judged_at = -1  # the statistics step whose applied-mean error was judged last
        self.state.stage_control(self.carry.staged())

    def decide(self, step: int, parameters: list[torch.Tensor]) -> Verdict:
        norm = self.state.gradient_norm(parameters)
        rows = self._rows()
        nonfinite = any(r.nonfinite for r in rows) or not math.isfinite(norm)
        self.announced = max(r.plan_offer for r in rows)
        losses = [r.loss for r in rows if r.loss is not None]
        loss = (math.fsum(losses) / len(losses) if all(map(math.isfinite, losses)) else float("nan")) \
            if losses else None
        errors = [r.worst_error for r in rows if r.worst_error is not None]
        if nonfinite and self.grad_scaler is not None and self.grad_scaler.get_scale() > 1.0:
            self.overflows += 1
            return Verdict(skip_update=True, changed=False)
        return self.guard.observe(step, nonfinite, loss, max(errors) if errors else None,
                                  norm if math.isfinite(norm) else 0.0, compressing=self.compressing)

    @property
    def compressing(self) -> bool:
        """Whether raycomp changes this step's training: the plan in force compresses, or
        the guard holds one that does off (its rules then judge the recovery). Under a
        dense plan of the controller's the guard only skips a non-finite gradient."""
        return self.guard.active or not self.state.plan.trains_as_ddp

    def judge_inner(self, parameters: list[torch.Tensor]) -> bool:
        """Local steps: whether this rank may apply its own inner step. Nothing is exchanged,
        so only this rank's gradient is judged, against its own recent norms: a non-finite
        gradient, or a norm above ``grad_norm_factor`` x their level, is skipped on this rank
        alone (its replica), never averaged into the next sync."""
        norm = self.state.gradient_norm(parameters)  # of this rank's own gradients here
        if not math.isfinite(norm) or \
                self.guard.spike_level(norm, self.inner_norms, self.guard.grad_norm_factor) is not None:
            return False
        self.inner_norms.append(norm)
        return True

    def judge_sync(self, step: int, rows: list[list[float]]) -> Verdict:
        """A sync of local steps, from the rows that rode inside it (the same on every rank):
        per rank a :class:`~raycomp._internal.wire.control_rows.SyncRow`, as floats. The mean of their
        losses is judged like a step's loss; there is no reduced gradient to judge."""
        synced = [SyncRow.from_row(r) for r in rows]
        nonfinite = any(r.nonfinite for r in synced)
        losses = [r.mean_loss for r in synced if r.mean_loss is not None]
        loss = math.fsum(losses) / len(losses) if losses else None
        return self.guard.observe(step, nonfinite, loss, None, grad_norm=None)

    def judge_late(self, step: int, loss: float) -> Verdict:
        """The mean over ranks of a loss that waited for an agreement (the same on every
        rank: it came out of one all-gather), judged as its step's loss would have been.
        Only a dense step leaves its loss out, and under a dense plan nothing falls back:
        the loss joins the window the first compressed steps are judged against. Call it
        for each, oldest first."""
        return self.guard.observe(step, False, loss, None, grad_norm=None, compressing=self.compressing)

    def judge_error(self, step: int, error: float, where: str = "") -> Verdict:
        """The applied mean's worst relative compression error over the layers of a
        statistics step (:mod:`raycomp._internal.reduce.mean_error`: the same on every rank; ``where``: its
        layer and step), judged at ``step`` against ``max_compression_error`` (no step's
        judgement: no clean step counts); a fallback starts at the step after ``step``."""
        return self.guard.observe_error(step, error, where)

    def judge_mean_error(self, step: int) -> Verdict | None:
        """At an agreement: the applied mean's compression error on the latest statistics
        step, if that step compressed per step and was not judged yet (the same on every
        rank: one all-gather, :mod:`raycomp._internal.reduce.mean_error`), its worst layer's
        judged at ``step`` (:meth:`judge_error`); None when there is none to judge."""
        if not self.state.measures_mean_error:
            return None
        plan, stats_step = self.state.stats_plan, self.state.stats_step
        if plan is None or stats_step <= self._errors_judged_at or plan.trains_as_ddp or plan.local_steps is not None:
            return None
        self._errors_judged_at = stats_step
        errors = layer_errors(self.state.mean_samples, self.layers, self.state.position, self.group)
        if not errors:
            return None
        layer = max(errors, key=errors.__getitem__)
        return self.judge_error(step, errors[layer], f"{layer}, step {stats_step}")

    def changed(self, verdict: Verdict | None) -> GuardEvent | None:
        """The event of a verdict that changed the fallback state (logged), else None."""
        if verdict is None or not verdict.changed:
            return None
        event = self.guard.events[-1]
        held = f"; dense until {self.guard.stable_steps} clean steps in a row" if event.kind == "fallback" else ""
        log.warning("guard %s at step %d: %s (%s)%s", event.kind, event.step, event.reason, event.detail, held)
        return event

    def stage(self, loss: float, applied: bool, offer: int = 0) -> None:
        """What rides in the next step's collective: this step's loss (unless the step was
        skipped: a discarded step's loss is not judged), worst compression error, and
        ``offer``, the version of a plan rank 0 holds and has not handed out (so that every
        rank learns of it one step later, with no collective of its own: :attr:`announced`)."""
        # each rank's own error, where the state does not measure the applied mean's
        fresh = self.state.stats_step == self.state.step - 1 and not self.state.measures_mean_error
        worst = max((s.compression_error for s in self.state.stats), default=None) if fresh else None
        self.carry = GuardRow(loss=loss if applied else None, plan_offer=offer,
                              worst_error=worst if worst is not None and math.isfinite(worst) else None)
        self.state.stage_control(self.carry.staged(), skippable=not (self.every_step or self.guard.active))

    def _rows(self) -> list[GuardRow]:
        rows = self.state.control_rows
        self.left_out = None
        if rows is None and self.state.control_skipped:  # left out on purpose: judged late
            self.left_out = self.carry.loss
            return [GuardRow() for _ in range(self.world_size)]
        if rows is None:  # nothing carried this step: one small all-reduce instead
            rows = torch.zeros(self.world_size, GuardRow.WIDTH, dtype=torch.float32)
            rows[self.rank] = torch.tensor(self.carry.to_row())  # no flag: only a reduction sets it
            if self.world_size > 1:
                dist.all_reduce(rows, group=self.group)
        self.state.control_rows = None
        return [GuardRow.from_row(r) for r in rows.tolist()]

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), "carry": self.carry.staged(), "inner_norms": list(self.inner_norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state["guard"])
        # a checkpoint from before the plan offer carries three values: none offered
        self.carry = GuardRow.from_staged([*state["carry"], 0.0][:GuardRow.WIDTH - 1])
        self.inner_norms.clear()
        self.inner_norms.extend(state["inner_norms"])
        self.state.stage_control(self.carry.staged())
