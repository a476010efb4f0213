"""One owner for the plan between the controller and the ranks.

It holds what the controller offered (rank 0's long poll, never waited for), the controller's
plan every rank agreed on, the plan in force (that plan, or the guard's dense override,
installed into the gradient state and written down by the :class:`PlanLog`), when a plan
takes effect, and the losses of dense steps that rode in no collective. The collectives it
calls: :mod:`raycomp._internal.train.plan_agreement`.

A plan reaches the ranks one of two ways:

* per step: rank 0 puts the version of a plan it holds (:meth:`PlanHandoff.offer`) in the
  next step's control rows (staged by :class:`~raycomp._internal.train.step_judge.StepJudge`);
  every rank reads the same announcement out of them (:meth:`PlanHandoff.hear`), and after
  that step a broadcast hands the plan out (:meth:`PlanHandoff.hand_out`), in force from
  the step after it;
* at an agreement (:meth:`PlanHandoff.agree`): at each control boundary, or
  :attr:`PlanHandoff.agree_after` steps later, one all-gather proves the ranks hold the same
  plan and guard state, carries the late losses and hands out an answer not announced yet.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from raycomp._internal.guard import Guard
from raycomp._internal.train.plan_agreement import Agreed, PlanAgreement
from raycomp._internal.train.plan_log import PlanLog
from raycomp._internal.train.reporter import Outages
from raycomp._internal.train.step_log import is_dense
from raycomp.plan import Plan

__all__ = ["ANSWER_STEPS", "PlanHandoff"]

#: steps an agreement waits after its boundary for the controller's answer (``dense_control:
#: at_boundaries``): its decision takes a few ms, a step tens to hundreds
ANSWER_STEPS = 2


class PlanHandoff:
    """Args:
        controller: the controller actor handle (None: train on the initial plan).
        group: the process group of control messages (gloo; None: the default group).
        state: the rank's gradient state, where the plan in force is installed.
        guard: the rank's guard; while it holds a fallback the plan in force is dense.
        plan_log: rank 0's plan timeline.
        options: the run's options (its ``controller`` section says when plans take effect).
    """

    def __init__(self, rank: int, world_size: int, group: Any, controller: Any, run_id: str, outages: Outages, *,
                 state: Any, guard: Guard, plan_log: PlanLog, options: Any) -> None:
        self.rank, self.controller, self.run_id, self.outages = rank, controller, run_id, outages
        self.state, self.guard, self.plan_log = state, guard, plan_log
        control = options.controller
        self.interval = control.interval_steps
        #: the early first boundary (``controller.first_interval_steps``), if before the first K
        self.first_boundary = control.first_interval_steps if control.first_interval_steps < self.interval else None
        #: steps from a boundary to its agreement. With ``dense_control: every_step`` a plan
        #: rides in the next step's values whenever it arrives, so the ranks agree at the
        #: boundary itself. With ``at_boundaries`` a dense step carries no values and the
        #: agreement is how a plan reaches the ranks: it waits :data:`ANSWER_STEPS` steps
        #: (fewer when K is smaller) for the controller's answer to the boundary's statistics,
        #: which then is in force from the step after it, as soon as a step's values would
        #: have brought it
        self.agree_after = 0 if control.dense_control == "every_step" else min(ANSWER_STEPS, self.interval - 1)
        self.agreement = PlanAgreement(rank, world_size, group, late_slots=guard.losses.maxlen or 0)
        self.controller_plan = Plan()  #: the controller's plan every rank holds (:meth:`register` on)
        self.ready: Plan | None = None  # rank 0: a newer plan the controller offered, not yet handed out
        self._poll: tuple[Any, Any] | None = None  # rank 0's long poll in flight: (ObjectRef, its future)
        self.announced = 0  # the version rank 0 announced in the latest step's rows (0: none)
        #: this rank's losses that rode in no collective (dense steps that left their values
        #: out), oldest first: the next agreement carries them (only a window's worth counts)
        self.late: deque[float] = deque(maxlen=guard.losses.maxlen)
        self.switches = 0  # controller plans adopted since the run began

    # --- when -----------------------------------------------------------------------------------
    def reports_at(self, steps: int) -> bool:
        """Whether a control boundary follows the first ``steps`` steps (statistics go out)."""
        return steps > 0 and (steps % self.interval == 0 or steps == self.first_boundary)

    def agrees_at(self, steps: int) -> bool:
        """Whether the ranks agree after the first ``steps`` steps (a boundary's agreement)."""
        return self.reports_at(steps - self.agree_after)

    # --- the controller and rank 0 ----------------------------------------------------------------
    def register(self, layers: dict[str, list[int]], options: Any, per_node: int = 1,
                 node_link: float | None = None) -> None:
        """Rank 0 registers the run (idempotent: a restarted run keeps its controller state);
        every rank gets the controller's current plan and installs it. ``per_node``: the
        ranks of a node of a two-level run, 1 when flat; ``node_link``: seconds per byte of an
        all-reduce inside rank 0's node (:mod:`raycomp._internal.node_link`), None when not timed."""
        import ray

        plan = None
        if self.rank == 0 and self.controller is not None:
            c = options.compression
            try:
                plan = Plan.from_dict(ray.get(self.controller.register_run.remote(
                    self.run_id, self.agreement.world_size, layers, c.policy, c.policy_options(), c.warmup_steps,
                    options.controller.interval_steps, c.min_compress_numel, options.eval_kind, per_node,
                    node_link), timeout=60))
            except Exception as error:  # noqa: BLE001 - the controller is optional
                self.outages.add(error, 0)
        fallback = Plan(reason="warm-up: dense" if self.controller is not None else "no controller: dense")
        self.controller_plan = self.agreement.broadcast(plan or fallback) or fallback
        self.state.set_plan(self.controller_plan)

    def offer(self) -> int:
        """Rank 0, every step: take the long poll's answer if it is in (never waiting for
        it), keep one poll in flight, and return the version of a plan it holds and has not
        handed out, for the next step's rows (0: none; other ranks: 0)."""
        if self.controller is None or self.rank != 0:
            return 0
        known = self.controller_plan.version
        if self._poll is not None:
            if not self._poll[1].done():
                return self.ready_version  # still in flight: never wait for it
            try:
                answer = self._poll[1].result()
                plan = None if answer is None else Plan.from_dict(answer)
                if plan is not None and plan.version > max(known, self.ready_version):
                    self.ready = plan
            except Exception as error:  # noqa: BLE001
                self.outages.add(error, known)
            self._poll = None
        try:
            # a long poll: answers as soon as a plan newer than the newest known exists. Ray's
            # own thread sets its future when the answer arrives, so the check above reads a
            # flag, where ``ray.wait(timeout=0)`` would ask Ray every step
            ref = self.controller.plan.remote(self.run_id, max(known, self.ready_version), 30.0)
            self._poll = (ref, ref.future())
        except Exception as error:  # noqa: BLE001
            self.outages.add(error, known)
        return self.ready_version

    @property
    def ready_version(self) -> int:
        """Rank 0: the version of the plan it holds and has not handed out (0: none)."""
        return 0 if self.ready is None else self.ready.version

    def _take(self) -> Plan | None:
        """Rank 0: the ready plan, handed out once."""
        plan, self.ready = self.ready, None
        return plan

    # --- every rank ---------------------------------------------------------------------------------
    def hear(self, announced: int, left_out: float | None) -> None:
        """What a step's rows said (the same on every rank): the version rank 0 announced;
        and, where the step's values rode in no collective, this rank's loss they held."""
        self.announced = announced
        if left_out is not None:
            self.late.append(left_out)

    def hand_out(self) -> bool:
        """After a step whose rows announced a plan newer than the controller's in force:
        rank 0's plan on every rank (a broadcast; none when nothing was announced), adopted
        from the next step. Returns whether it was (then :meth:`install` it)."""
        if self.announced <= self.controller_plan.version:
            return False
        return self.adopt(self.agreement.broadcast(self._take()))

    def agree(self, step: int, skipped_steps: int, schedule: tuple[float, ...], notice: float) -> Agreed:
        """The agreement after ``step`` steps: rank 0 checks for the controller's answer;
        one all-gather proves every rank holds the same plan, guard state (``skipped_steps``,
        fallback active, events) and ``schedule`` (the gradient strategy's numbers), carries
        the late losses and each rank's preemption ``notice``, and hands out rank 0's offer.
        Adopt the offer (:meth:`adopt`) after judging the late losses it returns."""
        self.offer()
        offer = self._take()
        late = list(self.late)
        self.late.clear()
        guard = (float(skipped_steps), float(self.guard.active), float(len(self.guard.events)), float(len(late)))
        return self.agreement.agree(self.state.plan, (*guard, *schedule), offer, step, late, notice)

    def adopt(self, plan: Plan | None) -> bool:
        """Make ``plan`` (the same on every rank) the controller's plan, if newer; returns
        whether it was (then :meth:`install` it)."""
        if plan is None or plan.version <= self.controller_plan.version:
            return False
        self.controller_plan = plan
        self.switches += 1
        return True

    def install(self, step: int, kind: str = "plan") -> bool:
        """Install the plan in force (the guard's dense override, or the controller's) from
        ``step``; rank 0 logs the switch (``kind``: plan, fallback, recovered). Returns whether
        compression (re)starts with it: a dense plan gave way to one that compresses."""
        plan = Plan(version=self.controller_plan.version, dense=True, reason=f"guard: {self.guard.reason}") \
            if self.guard.active else self.controller_plan
        before = self.state.plan
        self.state.set_plan(plan)
        self.plan_log.switch(step, kind, before, plan, held=self.controller_plan if self.guard.active else None)
        return is_dense(before) and not is_dense(plan)

    @property
    def summary(self) -> str:
        """The plan in force, in a few words."""
        return self.plan_log.summary(self.state.plan)

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"controller_plan": self.controller_plan.to_dict(), "switches": self.switches, "late": list(self.late)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller_plan = Plan.from_dict(state["controller_plan"])
        self.switches = state["switches"]
        self.late.clear()
        self.late.extend(state["late"])
