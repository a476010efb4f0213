"""The control loop of one worker, composed of small parts.

Per step (the hot path): the rank's gradient strategy (:mod:`raycomp.train.gradient_strategy`: the
DDP hook, or FSDP2's reduce-scatter) has reduced the gradients (compressed as the plan
says, with the guard's control rows riding inside the last collective); the guard decides
from the reduced gradient and those rows (:mod:`raycomp._internal.train.step_judge`); the optimizer
steps unless the guard skips; the step is logged. Nothing else talks to other ranks, except
one broadcast at a step where rank 0 has announced a new plan in those rows. During local
steps (:mod:`raycomp._internal.train.local_strategy`) nothing is reduced: each rank judges its own inner
step, and every H steps a sync averages the pseudo-gradients and the guard judges it.

Every ``interval_steps``, and once after the run's first ``first_interval_steps`` (a control
boundary): statistics go to the controller (:mod:`raycomp._internal.train.reporter`). Then, at the
boundary or :attr:`TrainLoop.agree_after` steps later, the ranks prove they hold the same plan
and guard state, and rank 0's newest plan is broadcast and installed for the next step
(:mod:`raycomp._internal.train.plan_agreement`). Every ``checkpoint.every_steps`` steps, and at epoch
ends as :meth:`raycomp.config.CheckpointSection.at_report` says (by default the last
only), and at the agreement a preemption notice reaches
(:mod:`raycomp._internal.train.preemption`), the model, optimizer and every rank's compression state
go into a Ray Train checkpoint (:mod:`raycomp._internal.train.resume`, :mod:`raycomp._internal.train.checkpoint`); what goes to
``ray.train.report`` and the run's totals: :mod:`raycomp._internal.train.ray_report`.

:class:`TrainLoop` is larger than a part because it is the composition: the order of what
a step and a boundary do, read in one place; what each of them does lives in its part.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.guard import Guard
from raycomp._internal.reduce.loss_scale import unscale_once
from raycomp._internal.reduce.mean_error import layer_errors
from raycomp._internal.train import checkpoint
from raycomp._internal.train.default_strategy import raycomp_strategy
from raycomp._internal.train.lr_ramp import LrRamp
from raycomp._internal.train.outputs import run_outputs
from raycomp._internal.train.plan_agreement import PlanAgreement
from raycomp._internal.train.plan_log import PlanLog
from raycomp._internal.train.preemption import PreemptionWatch, local_notice, ray_preemption_info
from raycomp._internal.train.ray_report import (
    any_rank,
    check_report_checkpoint,
    eval_value,
    report_metrics,
    report_to_ray,
    run_totals,
)
from raycomp._internal.train.reporter import Outages, StatsReporter
from raycomp._internal.train.resume import restore, save_state
from raycomp._internal.train.step_arguments import SchedulerInterval, check_clip, check_scheduler
from raycomp._internal.train.step_judge import StepJudge
from raycomp._internal.train.step_log import StepLog
from raycomp._internal.wire.control_rows import SyncRow
from raycomp.plan import Plan
from raycomp.train.gradient_strategy import GradientStrategyFactory, StrategySetup
from raycomp.train.options import TrainOptions

__all__ = ["TrainLoop"]

log = logging.getLogger("raycomp.train")

#: steps an agreement waits after its boundary for the controller's answer (``dense_control:
#: at_boundaries``): its decision takes a few ms, a step tens to hundreds
ANSWER_STEPS = 2


class TrainLoop:
    """raycomp inside one Ray Train worker; built by :func:`raycomp.train.prepare_model`.

    Holds a thread (the hook's communication thread) and a log file: use it as a context
    manager or call :meth:`finish`.

    Two options serve a framework that drives the step itself (Lightning, the Hugging Face
    Trainer: :mod:`raycomp.integrations`), which calls :meth:`after_backward` and
    :meth:`after_optimizer_step` around its own optimizer step:

    * ``owns_optimizer=False``: the framework zeroes the gradients and updates the
      GradScaler after its optimizer step, so :meth:`after_optimizer_step` leaves both to it
      (a second ``GradScaler.update()`` would fail). Pass ``scheduler=None`` too when the
      framework steps its own scheduler.
    * ``resume``: how the loop takes back a checkpoint's state, ``resume(loop)``, called once
      in the constructor (default: :func:`raycomp._internal.train.resume.restore`, from
      ``ray.train.get_checkpoint()``, model and optimizer included). A framework that
      restores the model and optimizer from its own checkpoint passes a function that
      restores raycomp's part only (:func:`raycomp._internal.train.resume.load_own`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
                 options: TrainOptions, controller: Any = None, grad_scaler: torch.amp.GradScaler | None = None,
                 gradient_strategy: GradientStrategyFactory = raycomp_strategy, owns_optimizer: bool = True,
                 resume: Callable[[TrainLoop], None] | None = None,
                 scheduler_interval: SchedulerInterval | None = None) -> None:
        import ray.train
        import ray.train.torch

        check_scheduler(scheduler, scheduler_interval)
        self.scheduler_interval = scheduler_interval
        # prepare_model, the only caller, has refused a scaler this loop cannot follow and
        # resolved the options. A disabled scaler (GradScaler(enabled=False), common behind
        # a flag) scales nothing
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.options, self.interval = options, options.controller.interval_steps
        #: the early first boundary (``controller.first_interval_steps``), if before the first K
        self.first_boundary = options.controller.first_interval_steps \
            if options.controller.first_interval_steps < self.interval else None
        every_step = options.controller.dense_control == "every_step"
        #: steps from a boundary to its agreement. With ``dense_control: every_step`` a plan
        #: rides in the next step's values whenever it arrives, so the ranks agree at the
        #: boundary itself. With ``at_boundaries`` a dense step carries no values and the
        #: agreement is how a plan reaches the ranks: it waits :data:`ANSWER_STEPS` steps
        #: (fewer when K is smaller) for the controller's answer to the boundary's statistics,
        #: which then is in force from the step after it, as soon as a step's values would
        #: have brought it
        self.agree_after = 0 if every_step else min(ANSWER_STEPS, self.interval - 1)
        self.run_id = options.run_id or context.get_experiment_name()
        #: where the run's files go (:mod:`raycomp._internal.train.outputs`: the Ray Train run's directory
        #: under its storage path unless ``options.output_dir`` says)
        self.outputs = run_outputs(options.output_dir, self.run_id, context)
        self.output_dir = self.outputs.directory
        # control messages always travel on gloo (CPU), whatever carries the gradients
        backend = dist.get_backend() if dist.is_initialized() else None
        self.control_group = dist.new_group(backend="gloo") if backend not in (None, "gloo") else None
        self.strategy = gradient_strategy(model, optimizer, StrategySetup(options, ray.train.torch.get_device(),
                                                              self.control_group, self.grad_scaler))
        self.model, self.state, self.sharded = self.strategy.model, self.strategy.state, self.strategy.sharded
        self.optimizer, self.scheduler, self.owns_optimizer = optimizer, scheduler, owns_optimizer
        module = getattr(self.model, "module", self.model)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.outages = Outages()
        guard = Guard(**options.compression.guard.model_dump())
        self.plans = PlanAgreement(self.rank, self.world_size, self.control_group, controller, self.run_id,
                                   self.outages, late_slots=guard.losses.maxlen or 0)
        self.guard = StepJudge(guard, self.state, self.rank, self.world_size, self.control_group,
                               self.grad_scaler, every_step=every_step)
        self.reporter = StatsReporter(controller, self.run_id, self.rank, self.outages)
        self.log = StepLog(self.output_dir, self.rank, options.progress_every)
        self.global_step = self.epoch = self.plan_switches = self.skipped_steps = 0
        self.local_skips = 0  # inner steps this rank skipped on its own (local steps)
        self.outer_steps = 0  # syncs of local steps whose outer step was applied (every rank alike)
        self.steps_per_epoch: int | None = None
        self.epochs_total: int | None = None
        #: the step count at which training ends, where known (:meth:`epochs` sets it; the
        #: framework integrations from the trainer's budget): that last step merges local
        #: steps' replicas (:meth:`merge_replicas`), before what evaluates and saves the model
        self.last_step: int | None = None
        self.restored_from: int | None = None
        self.control_seconds = self.step_seconds = 0.0  # the controller's share of a rank's time
        self.boundary_seconds = 0.0  # the part of control_seconds spent at boundaries
        self.lr_ramp = LrRamp(options.compression.lr_scaling)
        # read at agreements when raycomp owns the step (a framework checkpoints itself)
        self.preemption = PreemptionWatch((local_notice() or ray_preemption_info())
                                          if options.checkpoint.on_preemption and owns_optimizer else None)
        self._notice_checkpoint = False  # the latest agreement calls for a checkpoint
        self._lr_used = self._loss_value = 0.0
        # shapes, not element counts: the adaptive policy sizes PowerSGD's factors from them
        per_node = getattr(self.strategy, "per_node", 1)  # optional, as time_node_link
        timer = getattr(self.strategy, "time_node_link", None)
        node_link = timer() if per_node > 1 and timer is not None else None  # every rank: collective
        self.controller_plan = self.plans.register(self.strategy.layers(), options, options.eval_kind,
                                                   per_node, node_link)
        self.state.set_plan(self.controller_plan)
        (resume or restore)(self)
        self.replayed_steps = self.log.open(self.restored_from)
        # the layers a plan can compress (smaller ones travel dense whatever it says): what a
        # plan's summary counts, e.g. "topk(ratio=0.01) on 12/14 layers"
        self.compressible = [name for name, shape in self.strategy.layers().items()
                             if math.prod(shape) >= options.compression.min_compress_numel]
        self.timeline = PlanLog(self.output_dir, self.rank, self.compressible)
        self.timeline.open(self.state.plan, self.restored_from)
        self.log.plan_summary = self.timeline.summary(self.state.plan)
        self._restart_step_clock()

    # --- the loop ---------------------------------------------------------------------------
    def epochs(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        """Epoch numbers still to train (a resumed run starts mid-way; see :attr:`step_in_epoch`).
        With local steps, the last epoch's last step ends with the ranks' weights merged
        (:meth:`merge_replicas`), so that its evaluation, report and checkpoint see one model."""
        self.epochs_total, self.steps_per_epoch = epochs, steps_per_epoch
        self.last_step = epochs * steps_per_epoch
        for epoch in range(self.global_step // steps_per_epoch, epochs):
            self.epoch = epoch
            yield epoch

    @property
    def step_in_epoch(self) -> int:
        """The first batch of the current epoch still to train."""
        return self.global_step - self.epoch * (self.steps_per_epoch or 0)

    def step(self, loss: torch.Tensor, samples: int = 0, clip_grad_norm: float | None = None) -> bool:
        """After ``loss.backward()``: guard, optimizer step (unless skipped), boundary.
        Returns whether the optimizer step was applied. ``clip_grad_norm``: clip the reduced
        gradient (each rank's own during local steps) to this norm after the guard judged
        it, before the optimizer steps."""
        check_clip(clip_grad_norm)
        applied = self.after_backward(loss)
        if applied and clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, clip_grad_norm)
        if applied:
            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)
        self.after_optimizer_step(loss, samples, applied)
        return applied

    # the two halves of :meth:`step`, for a framework that steps the optimizer itself
    def after_backward(self, loss: torch.Tensor | float) -> bool:
        """Finish the step's reduction, unscale (fp16), let the guard judge the gradient.
        Returns whether the optimizer may step (False: the guard skips this step)."""
        if self.scheduler is not None and self.scheduler_interval == "epoch" and not self.steps_per_epoch:
            raise RuntimeError("scheduler_interval='epoch': raycomp knows where epochs end only from "
                               "loop.epochs(epochs, steps_per_epoch); iterate that, or pass scheduler_interval='step'")
        self.strategy.end_backward()
        self._loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        started = time.perf_counter()
        if self.grad_scaler is not None:  # the guard judges the gradient itself
            unscale_once(self.grad_scaler, self.optimizer)
        if self.strategy.per_step:
            verdict = self.guard.decide(self.global_step, self._params)
            self._verdict(verdict)
            applied = not verdict.skip_update
            self.plans.check(self.controller_plan.version)  # rank 0: a new plan is in?
            self.guard.offer = self.plans.ready_version  # then it rides with the next step
            self.guard.stage(self._loss_value, applied)
        else:  # local steps: the rank judges its own inner step; the guard judges syncs
            applied = self.guard.judge_inner(self._params)
        self.control_seconds += time.perf_counter() - started
        self._lr_used = self.optimizer.param_groups[0]["lr"] * self.lr_ramp.factor(self.global_step)
        return applied

    def after_optimizer_step(self, loss: torch.Tensor | float | None = None, samples: int = 0,
                             applied: bool = True) -> None:
        """After the optimizer step (or its skip): the gradient strategy's own after-step work
        (local steps merge ranks here), the scaler's update and zeroed gradients (unless
        the framework owns the optimizer), the scheduler's step, the step log and, every
        ``interval_steps``, a control boundary."""
        loss_value = self._loss_value if loss is None else \
            float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if not applied and self.strategy.per_step:
            self.skipped_steps += 1
            self.state.discard_step()
        elif not applied:
            self.local_skips += 1  # this rank's own: only its replica skipped the step
        self._sync_finished(self.strategy.after_optimizer_step(applied, loss_value), self.global_step)
        if self.owns_optimizer:  # else the framework did both after its optimizer step
            if self.grad_scaler is not None:
                self.grad_scaler.update()  # backs off after an overflow, grows after clean steps
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self._finish_step(loss_value, samples, applied)

    def _sync_finished(self, rows: list[list[float]] | None, step: int) -> None:
        """A sync of local steps finished (``rows``, else None): count it, the guard judges it."""
        if rows is not None:
            # a non-finite mean skips the outer step
            self.outer_steps += not any(SyncRow.from_row(row).nonfinite for row in rows)
            self._verdict(self.guard.judge_sync(step, rows))

    def drain(self) -> None:
        """Before a checkpoint or the totals: a sync still on the wire finishes, counted and
        judged like one that finishes in a step (after the step just taken). Whatever writes
        this rank's state (``save_state``, the framework integrations) calls it first."""
        drain = getattr(self.strategy, "drain", None)  # optional: GradientStrategy's docstring
        if drain is not None:
            self._sync_finished(drain(), self.global_step - 1)

    def merge_replicas(self) -> None:
        """Local steps: finish a sync on the wire (:meth:`drain`), then sync every fragment,
        so that every rank holds the same weights (DiLoCo's last outer step), counted with
        the outer steps. At :attr:`last_step` and in :meth:`totals`; a no-op
        per step or where the ranks hold the same weights already."""
        self.drain()
        merge = getattr(self.strategy, "merge", None)  # optional: GradientStrategy's docstring
        if merge is not None:
            self.outer_steps += merge()

    def _verdict(self, verdict: Any) -> None:
        """Act on a guard verdict that changed the fallback state: log, report, install."""
        if verdict.changed:
            event = self.guard.guard.events[-1]
            self.reporter.events.append(event.to_dict())
            held = f"; dense until {self.guard.guard.stable_steps} clean steps in a row" \
                if event.kind == "fallback" else ""
            log.warning("guard %s at step %d: %s (%s)%s", event.kind, event.step, event.reason, event.detail, held)
            self._install(self.controller_plan, event.step + 1, event.kind)

    def _finish_step(self, loss: float, samples: int, applied: bool) -> None:
        seconds = time.perf_counter() - self._step_started  # this step's own time
        self.reporter.record(loss, seconds, self.state.comm_seconds - self._comm_at_step_start, samples)
        plan = self.state.plan
        self.log.write({
            "step": self.global_step, "epoch": self.epoch, "time": time.time(), "plan_version": plan.version,
            "plan_digest": plan.digest(), "dense": _is_dense(plan), "loss": loss, "lr": self._lr_used,
            "applied": applied, "fallback": self.guard.guard.active, "seconds": seconds,
            "wire_bytes": self.state.ledger.wire_total, "dense_bytes": self.state.ledger.dense_total,
        }, samples)
        self.global_step += 1
        self.step_seconds += seconds
        if self.scheduler is not None and self.scheduler_interval == "epoch" \
                and self.global_step % self.steps_per_epoch == 0:  # type: ignore[operator]
            self.scheduler.step()  # the epoch's last step: before its report checkpoints
        if self.global_step == self.last_step:
            self.merge_replicas()  # the run's last step: what is evaluated and saved next is merged
        if self.strategy.per_step and self.guard.announced > self.controller_plan.version:
            # rank 0 announced a new plan in this step's rows, the same on every rank: hand
            # it out now, in force from the next step (not from the next boundary)
            self._adopt(self.plans.broadcast(self.plans.take()))
        reports, agrees = self._is_boundary(self.global_step), self._is_boundary(self.global_step - self.agree_after)
        self._notice_checkpoint = False
        if reports or agrees:
            started = time.perf_counter()
            if reports:
                self._report_statistics()
            if agrees:
                self._adopt(self.agree_on_plan(self.plans.poll(self.controller_plan.version)))
            self.boundary_seconds += time.perf_counter() - started
            self.control_seconds += time.perf_counter() - started
        every = self.options.checkpoint.every_steps
        epoch_end = bool(self.steps_per_epoch) and self.global_step % self.steps_per_epoch == 0  # type: ignore[operator]
        if self._notice_checkpoint or (every and self.global_step % every == 0 and not epoch_end):
            self.report({}, checkpoint=True)  # the epoch's own report checkpoints epoch ends
        self._restart_step_clock()

    def _restart_step_clock(self) -> None:
        """The next step's time (and its communication share) counts from now. Called after
        a step, and after an evaluation or a report: their time is not a step's, and counting
        it would inflate the compute time the adaptive policy's cost model works from (by
        several times, with an evaluation every few steps)."""
        self._comm_at_step_start = self.state.comm_seconds
        self._step_started = time.perf_counter()

    # --- control boundary -------------------------------------------------------------------
    def _is_boundary(self, steps: int) -> bool:
        """Whether a control boundary follows the first ``steps`` steps."""
        return steps > 0 and (steps % self.interval == 0 or steps == self.first_boundary)

    def _report_statistics(self) -> None:
        self.log.flush()
        self.reporter.send(self.state, self.global_step - 1, self.epoch, self.guard.guard.active,
                           **self._report_counters())

    def _adopt(self, new_plan: Plan | None) -> None:
        """Make ``new_plan`` (the same on every rank) the controller's plan in force, if newer."""
        if new_plan is not None and new_plan.version > self.controller_plan.version:
            self.controller_plan = new_plan
            self.plan_switches += 1
            self._install(new_plan, self.global_step)

    def _report_counters(self) -> dict[str, Any]:
        """Skipped and outer steps so far, the loss scale and the learning rate (the largest
        group's, as the schedule has it: local steps' H follows its decay), for the
        controller's report."""
        scale = None if self.grad_scaler is None else self.grad_scaler.get_scale()
        lr = max(float(group["lr"]) for group in self.optimizer.param_groups)
        return {"skipped_steps": self.skipped_steps, "loss_scale": scale, "outer_steps": self.outer_steps,
                "lr": lr if math.isfinite(lr) and lr >= 0 else None}

    def agree_on_plan(self, offer: Plan | None) -> Plan | None:
        """Agreement check of plan and guard state; rank 0's ``offer`` on every rank. The
        losses that dense steps left out (:attr:`StepJudge.late`) ride along and are judged
        here, on every rank alike, before the offer is installed; so does the preemption
        notice each rank holds (:mod:`raycomp._internal.train.preemption`)."""
        guard = self.guard.guard
        late = self.guard.take_late()
        state = (float(self.skipped_steps), float(guard.active), float(len(guard.events)), float(len(late)),
                 *self.strategy.agreement())
        agreed = self.plans.agree(self.state.plan, state, offer, self.global_step, late, self.preemption.notice())
        for loss in agreed.late:
            self._verdict(self.guard.judge_late(self.global_step - 1, loss))
        self._judge_mean_error()
        # a preemption notice any rank holds: every rank checkpoints after this step
        self._notice_checkpoint = self.preemption.checkpoint_due(agreed.notice, self.global_step)
        return agreed.plan

    _errors_judged_at = -1  # the statistics step whose applied-mean error was judged last

    def _judge_mean_error(self) -> None:
        """The applied mean's compression error on the latest statistics step, if that step
        compressed per step and was not judged yet (the same on every rank: one all-gather,
        :mod:`raycomp._internal.reduce.mean_error`); the guard judges the worst layer's."""
        if not self.state.measures_mean_error:
            return
        plan, step = self.state.stats_plan, self.state.stats_step
        if plan is None or step <= self._errors_judged_at or plan.trains_as_ddp or plan.local_steps is not None:
            return
        self._errors_judged_at = step
        errors = layer_errors(self.state.mean_samples, self.compressible, self.state.position, self.control_group)
        if errors:
            layer = max(errors, key=errors.__getitem__)
            self._verdict(self.guard.judge_error(self.global_step - 1, errors[layer], f"{layer}, step {step}"))

    def _install(self, controller_plan: Plan, step: int, kind: str = "plan") -> None:
        """Install the effective plan (the guard's dense override, or the controller's), in
        force from ``step``; rank 0 logs the switch (``kind``: plan, fallback, recovered)."""
        guard = self.guard.guard
        plan = Plan(version=controller_plan.version, dense=True, reason=f"guard: {guard.reason}") \
            if guard.active else controller_plan
        before = self.state.plan
        if _is_dense(before) and not _is_dense(plan):
            self.lr_ramp.started_at = self.global_step  # compression (re)starts: ramp the LR
        self.state.set_plan(plan)
        self.timeline.switch(step, kind, before, plan, held=controller_plan if guard.active else None)
        self.log.plan_summary = self.timeline.summary(plan)

    # --- evaluations, reports, checkpoints ---------------------------------------------------
    _evaluated_at: int | None = None  # the step of the latest recorded evaluation

    def record_eval(self, metrics: dict[str, Any], value: float | None = None) -> None:
        """An evaluation: one line in rank 0's ``evals.jsonl``; ``value`` goes to the
        controller with the next statistics (a non-finite one does not: it would void them)."""
        self.log.write_eval(metrics, self.global_step, self.epoch)
        value = None if value is None else float(value)
        self.reporter.eval_metric = value if value is not None and math.isfinite(value) else None
        self._evaluated_at = self.global_step
        self._restart_step_clock()  # the evaluation ran since the last step: not step time

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        """``ray.train.report`` (a barrier on all ranks) with byte totals added. When
        ``metrics`` hold ``options.eval_metric``, also an evaluation (:meth:`record_eval`)
        unless one was recorded at this step already. With a checkpoint when asked (True,
        or a ``ray.train.Checkpoint`` whose files the reported one holds beside raycomp's;
        then every rank writes its state), or (None) as
        :meth:`raycomp.config.CheckpointSection.at_report` says
        (:mod:`raycomp._internal.train.ray_report`)."""
        user_checkpoint = check_report_checkpoint(checkpoint)
        name = self.options.eval_metric
        if name is not None and name in metrics and self._evaluated_at != self.global_step:
            self.record_eval(dict(metrics), eval_value(name, metrics[name]))
        self.log.flush()
        metrics = report_metrics(metrics, self.epoch, self.global_step, self.state.ledger, self.world_size)
        if checkpoint is None:
            checkpoint = self.options.checkpoint.at_report(self.epoch, self.global_step, self.epochs_total,
                                                           self.steps_per_epoch)
        if self.world_size > 1:  # one rank's own checkpoint (or True): every rank's state goes in
            checkpoint = any_rank(bool(checkpoint), self.control_group)
        report_to_ray(metrics, self.save_state if checkpoint else None, user_checkpoint)
        self._restart_step_clock()  # the report (a barrier) and what came before it: not step time

    def save_state(self, directory: Path) -> None:
        """Write raycomp's checkpoint files into ``directory`` (yours, before ``ray.train.report``).
        A sync of local steps still on the wire finishes first, counted and judged, so that a
        run resumed from the files goes on as this one does."""
        self.drain()
        save_state(self, directory)

    def save_shared(self, directory: Path) -> None:
        """Rank 0's part of a checkpoint: the model (unless sharded), optimizer, scheduler, step."""
        meta = {"global_step": self.global_step, "epoch": self.epoch, "world_size": self.world_size}
        checkpoint.save_shared(directory, None if self.sharded else self.model, self.optimizer, self.scheduler, meta)

    # --- the end ------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Run totals over all ranks (a collective: call on every rank), after the ranks'
        weights are merged (:meth:`merge_replicas`): :func:`raycomp._internal.train.ray_report.run_totals`."""
        self.merge_replicas()
        return run_totals(self)

    def send_final(self) -> None:
        """Send the statistics since the last boundary (the final byte totals, the latest
        evaluation) and wait for the controller to take them; a second call sends nothing."""
        self.reporter.send(self.state, self.global_step - 1, self.epoch, self.guard.guard.active, final=True,
                           **self._report_counters())

    def close(self) -> None:
        """Send the last statistics (if :meth:`send_final` has not) and release the thread and files."""
        self.send_final()
        self.log.close()
        self.state.close()

    def __enter__(self) -> TrainLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_dense(plan: Plan) -> bool:
    return plan.dense or (plan.default.is_dense and all(s.is_dense for _, s in plan.layers))
