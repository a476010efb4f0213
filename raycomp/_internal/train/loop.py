"""The control loop of one worker: the order of what a step and a control boundary do, read
in one place; what each of them does lives in a part.

Per step (the hot path): the gradient strategy (:mod:`raycomp.train.gradient_strategy`) has
reduced the gradients, with the guard's control rows inside the last collective; the judge
decides from them (:mod:`raycomp._internal.train.step_judge`); the optimizer steps unless it
skips; the step is logged (:mod:`raycomp._internal.train.step_log`). During local steps each
rank judges its own inner step, and the judge judges every sync. At control boundaries the
statistics go to the controller (:mod:`raycomp._internal.train.reporter`), and plans travel
from the controller to every rank as :mod:`raycomp._internal.train.plan_handoff` says.
Checkpoints (:mod:`raycomp._internal.train.resume`) and the run's totals
(:mod:`raycomp._internal.train.ray_report`) read the loop's :meth:`TrainLoop.parts`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raycomp._internal.guard import Guard, Verdict
from raycomp._internal.reduce.loss_scale import unscale_once
from raycomp._internal.train import ray_report
from raycomp._internal.train.default_strategy import raycomp_strategy
from raycomp._internal.train.gradient_strategy import GradientState, StrategySetup
from raycomp._internal.train.gradient_strategy import GradientStrategyFactory as Factory
from raycomp._internal.train.lr_ramp import LrRamp
from raycomp._internal.train.options import TrainOptions
from raycomp._internal.train.outputs import run_outputs
from raycomp._internal.train.plan_handoff import PlanHandoff
from raycomp._internal.train.plan_log import PlanLog, compressible_layers
from raycomp._internal.train.preemption import PreemptionWatch, local_notice, ray_preemption_info
from raycomp._internal.train.reporter import Outages, StatsReporter
from raycomp._internal.train.resume import restore, save_shared, save_state
from raycomp._internal.train.run_state import InProgress, Progress, RankParts, StepClock
from raycomp._internal.train.step_arguments import SchedulerInterval, SchedulerSteps, check_clip
from raycomp._internal.train.step_judge import StepJudge
from raycomp._internal.train.step_log import StepLog
from raycomp._internal.wire.control_rows import SyncRow

__all__ = ["TrainLoop"]


class TrainLoop:
    """raycomp inside one Ray Train worker; built by :func:`raycomp.train.prepare_model`.

    Holds a thread and a log file: use it as a context manager or call :meth:`close`. A
    framework that steps the optimizer itself (:mod:`raycomp.integrations`) calls
    :meth:`after_backward` and :meth:`after_optimizer_step` around its step, with
    ``owns_optimizer=False`` (it zeroes the gradients, updates its GradScaler, steps its
    scheduler) and ``resume(parts)``, which takes a checkpoint's state back into
    :meth:`parts` (default: :func:`raycomp._internal.train.resume.restore`, from
    ``ray.train.get_checkpoint()``; raycomp's part only: :func:`~raycomp._internal.train.resume.load_own`).
    """

    #: where the run stands, kept in :attr:`progress` (:class:`~raycomp._internal.train.run_state.Progress`)
    global_step, epoch, last_step = InProgress(), InProgress(), InProgress()
    restored_from, skipped_steps = InProgress(), InProgress()
    local_skips, outer_steps = InProgress(), InProgress()

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
                 options: TrainOptions, controller: Any = None, grad_scaler: torch.amp.GradScaler | None = None,
                 gradient_strategy: Factory = raycomp_strategy, owns_optimizer: bool = True,
                 resume: Callable[[RankParts], None] | None = None,
                 scheduler_interval: SchedulerInterval | None = None) -> None:
        import ray.train
        import ray.train.torch

        self.schedule = SchedulerSteps(scheduler, scheduler_interval)
        # prepare_model has refused a scaler this loop cannot follow and resolved the options.
        # A disabled scaler (GradScaler(enabled=False), common behind a flag) scales nothing
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        context = ray.train.get_context()
        self.rank, self.world_size, self.options = context.get_world_rank(), context.get_world_size(), options
        run_id = options.run_id or context.get_experiment_name()
        self.outputs = run_outputs(options.output_dir, run_id, context)
        # control messages always travel on gloo (CPU), whatever carries the gradients
        backend = dist.get_backend() if dist.is_initialized() else None
        self.control_group = dist.new_group(backend="gloo") if backend not in (None, "gloo") else None
        self.strategy = gradient_strategy(model, optimizer, StrategySetup(options, ray.train.torch.get_device(),
                                                                          self.control_group, self.grad_scaler))
        self.optimizer, self.owns_optimizer = optimizer, owns_optimizer
        module = getattr(self.model, "module", self.model)
        self._params = [p for p in module.parameters() if p.requires_grad]
        layers = self.strategy.layers()  # shapes: the adaptive policy sizes PowerSGD's factors from them
        compressible = compressible_layers(layers, options.compression.min_compress_numel)
        outages, guard = Outages(), Guard(**options.compression.guard.model_dump())
        self.handoff = PlanHandoff(self.rank, self.world_size, self.control_group, controller, run_id, outages,
                                   state=self.state, guard=guard, options=options,
                                   plan_log=PlanLog(self.outputs.directory, self.rank, compressible))
        self.judge = StepJudge(guard, self.state, self.rank, self.world_size, self.control_group, self.grad_scaler,
                               every_step=options.controller.dense_control == "every_step", layers=compressible)
        self.reporter = StatsReporter(controller, run_id, self.rank, outages)
        self.log = StepLog(self.output_dir, self.rank, options.progress_every)
        self.progress, self.clock = Progress(), StepClock(self.state)
        self.lr_ramp = LrRamp(options.compression.lr_scaling)
        # read at agreements when raycomp owns the step (a framework checkpoints itself)
        self.preemption = PreemptionWatch((local_notice() or ray_preemption_info())
                                          if options.checkpoint.on_preemption and owns_optimizer else None)
        self._lr_used = self._loss_value = 0.0
        per_node = self.strategy.per_node
        node_link = self.strategy.time_node_link() if per_node > 1 else None  # every rank: collective
        self.handoff.register(layers, options, per_node, node_link)
        (resume or restore)(self.parts())
        self.progress.replayed_steps = self.log.open(self.restored_from)
        self.handoff.plan_log.open(self.state.plan, self.restored_from)
        self.log.plan_summary = self.handoff.summary
        self.clock.restart()

    @property
    def model(self) -> torch.nn.Module:
        return self.strategy.model

    @property
    def state(self) -> GradientState:
        return self.strategy.state

    run_id = property(lambda self: self.reporter.run_id, doc="The run's id (``options.run_id``, else Ray Train's).")
    output_dir = property(lambda self: self.outputs.directory, doc="Where the run's files go (:attr:`outputs`).")

    def parts(self) -> RankParts:
        """This rank's parts, as its checkpoint saves and restores them and its totals count."""
        return RankParts(self.rank, self.world_size, self.options.seed, self.strategy, self.optimizer,
                         self.schedule.scheduler, self.grad_scaler, self.judge, self.handoff, self.progress,
                         self.reporter.outages, self.lr_ramp, self.preemption)

    def epochs(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        """Epoch numbers still to train (a resumed run starts mid-way: :attr:`step_in_epoch`); the
        last one's last step merges local steps' replicas (:meth:`merge_replicas`)."""
        return self.progress.epochs(epochs, steps_per_epoch)

    @property
    def step_in_epoch(self) -> int:
        """The first batch of the current epoch still to train."""
        return self.progress.step_in_epoch

    def step(self, loss: torch.Tensor, samples: int = 0, clip_grad_norm: float | None = None) -> bool:
        """After ``loss.backward()``: the judge, the optimizer step (unless skipped; after
        clipping the reduced gradient to ``clip_grad_norm``), a boundary. Returns whether the
        optimizer step was applied."""
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
        """Finish the step's reduction, unscale (fp16), let the judge decide on the gradient.
        Returns whether the optimizer may step (False: the judge skips this step)."""
        self.schedule.check(self.progress.steps_per_epoch)
        self.strategy.end_backward()
        self._loss_value = _value(loss)
        started = time.perf_counter()
        if self.grad_scaler is not None:  # the guard judges the gradient itself
            unscale_once(self.grad_scaler, self.optimizer)
        if self.strategy.per_step:
            verdict = self.judge.decide(self.global_step, self._params)
            self.handoff.hear(self.judge.announced, self.judge.left_out)  # what the step's rows said
            self._verdict(verdict)
            applied = not verdict.skip_update
            # rank 0: a new plan from the controller rides with the next step
            self.judge.stage(self._loss_value, applied, offer=self.handoff.offer())
        else:  # local steps: the rank judges its own inner step; the judge judges syncs
            applied = self.judge.judge_inner(self._params)
        self.clock.since(started)
        self._lr_used = self.optimizer.param_groups[0]["lr"] * self.lr_ramp.factor(self.global_step)
        return applied

    def after_optimizer_step(self, loss: torch.Tensor | float | None = None, samples: int = 0,
                             applied: bool = True) -> None:
        """After the optimizer step (or its skip): the strategy's after-step work (local steps
        sync here), the scaler's update and zeroed gradients (unless the framework owns the
        optimizer), the scheduler's step, the step log and, where due, a control boundary."""
        loss_value = self._loss_value if loss is None else _value(loss)
        if not applied and self.strategy.per_step:
            self.progress.skipped_steps += 1
            self.state.discard_step()
        elif not applied:
            self.progress.local_skips += 1  # this rank's own: only its replica skipped the step
        self._sync_finished(self.strategy.after_optimizer_step(applied, loss_value), self.global_step)
        if self.owns_optimizer:  # else the framework did both after its optimizer step
            if self.grad_scaler is not None:
                self.grad_scaler.update()  # backs off after an overflow, grows after clean steps
            self.optimizer.zero_grad(set_to_none=True)
        self.schedule.after_step()
        self._finish_step(loss_value, samples, applied)

    def _sync_finished(self, rows: list[list[float]] | None, step: int) -> None:
        """A sync of local steps finished (``rows``, else None): count it, the judge judges it."""
        if rows is not None:
            # a non-finite mean skips the outer step
            self.progress.outer_steps += not any(SyncRow.from_row(row).nonfinite for row in rows)
            self._verdict(self.judge.judge_sync(step, rows))

    def drain(self) -> None:
        """Before this rank's state is written, or the totals: a sync still on the wire
        finishes, counted and judged like one that finishes in a step (after the last)."""
        self._sync_finished(self.strategy.drain(), self.global_step - 1)

    def merge_replicas(self) -> None:
        """Local steps, at :attr:`last_step` and in :meth:`totals`: :meth:`drain`, then sync
        every fragment, so that every rank holds the same weights (DiLoCo's last outer step)."""
        self.drain()
        self.progress.outer_steps += self.strategy.merge()

    def _verdict(self, verdict: Verdict | None) -> None:
        """Act on a verdict that changed the fallback state: report its event, install."""
        if (event := self.judge.changed(verdict)) is not None:
            self.reporter.events.append(event.to_dict())
            self._install(event.step + 1, event.kind)

    def _finish_step(self, loss: float, samples: int, applied: bool) -> None:
        seconds, comm_seconds = self.clock.step_done()  # this step's own time
        self.reporter.record(loss, seconds, comm_seconds, samples)
        self.log.write_step(self.global_step, self.epoch, self.state, loss, self._lr_used, applied,
                            self.judge.guard.active, seconds, samples)
        self.progress.global_step += 1
        per_epoch = self.progress.steps_per_epoch
        self.schedule.after_steps(self.global_step, per_epoch)
        if self.global_step == self.last_step:
            self.merge_replicas()  # the run's last step: what is evaluated and saved next is merged
        if self.strategy.per_step and self.handoff.hand_out():  # announced in this step's rows:
            self._install(self.global_step)  # in force from the next step, not the next boundary
        notice = self._boundary()
        every = self.options.checkpoint.every_steps
        epoch_end = bool(per_epoch) and self.global_step % per_epoch == 0  # type: ignore[operator]
        if notice or (every and self.global_step % every == 0 and not epoch_end):
            self.report({}, checkpoint=True)  # the epoch's own report checkpoints epoch ends
        self.clock.restart()

    def _boundary(self) -> bool:
        """After a boundary's step: statistics to the controller; after an agreement's, the
        agreement. Returns whether a preemption notice calls for a checkpoint now."""
        reports, agrees = self.handoff.reports_at(self.global_step), self.handoff.agrees_at(self.global_step)
        if not (reports or agrees):
            return False
        started = time.perf_counter()
        if reports:
            self.log.flush()
            self._send_statistics()
        notice = agrees and self.agree_on_plan()
        self.clock.since(started, boundary=True)
        return notice

    def _send_statistics(self, final: bool = False) -> None:
        """The statistics since the last boundary to the controller, with the skipped and
        outer steps so far, the loss scale and the learning rate (the largest group's, as the
        schedule has it: local steps' H follows its decay)."""
        scale = None if self.grad_scaler is None else self.grad_scaler.get_scale()
        lr = max(float(group["lr"]) for group in self.optimizer.param_groups)
        self.reporter.send(self.state, self.global_step - 1, self.epoch, self.judge.guard.active, final=final,
                           skipped_steps=self.skipped_steps, loss_scale=scale, outer_steps=self.outer_steps,
                           lr=lr if math.isfinite(lr) and lr >= 0 else None)

    def agree_on_plan(self) -> bool:
        """The agreement (:meth:`PlanHandoff.agree`): the late losses it carries are judged on
        every rank alike, then rank 0's newest plan installed. Returns whether a preemption
        notice any rank holds calls for a checkpoint after this step."""
        agreed = self.handoff.agree(self.global_step, self.skipped_steps, self.strategy.agreement(),
                                    self.preemption.notice())
        for loss in agreed.late:
            self._verdict(self.judge.judge_late(self.global_step - 1, loss))
        self._verdict(self.judge.judge_mean_error(self.global_step - 1))
        if self.handoff.adopt(agreed.plan):
            self._install(self.global_step)
        return self.preemption.checkpoint_due(agreed.notice, self.global_step)

    def _install(self, step: int, kind: str = "plan") -> None:
        """The plan in force from ``step`` (:meth:`PlanHandoff.install`; ``kind``: plan,
        fallback, recovered); the LR ramps where compression (re)starts."""
        if self.handoff.install(step, kind):
            self.lr_ramp.started_at = self.global_step  # compression (re)starts: ramp the LR
        self.log.plan_summary = self.handoff.summary

    def record_eval(self, metrics: dict[str, Any], value: float | None = None) -> None:
        """An evaluation: one line in rank 0's ``evals.jsonl``; ``value`` goes to the
        controller with the next statistics (a non-finite one does not: it would void them)."""
        self.log.write_eval(metrics, self.global_step, self.epoch)
        value = None if value is None else float(value)
        self.reporter.eval_metric = value if value is not None and math.isfinite(value) else None
        self.clock.restart()  # the evaluation ran since the last step: not step time

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        """``ray.train.report`` (a barrier on all ranks) with byte totals added; an evaluation
        too (:meth:`record_eval`) where ``metrics`` hold ``options.eval_metric`` and none was
        recorded at this step. With a checkpoint when asked (True, or a ``ray.train.Checkpoint``
        of yours, whose files the reported one holds beside raycomp's), or (None) as
        :meth:`raycomp.config.CheckpointSection.at_report` says (:mod:`~raycomp._internal.train.ray_report`)."""
        user_checkpoint = ray_report.check_report_checkpoint(checkpoint)
        name = self.options.eval_metric
        if name is not None and name in metrics and self.log.evaluated_at != self.global_step:
            self.record_eval(dict(metrics), ray_report.eval_value(name, metrics[name]))
        self.log.flush()
        metrics = ray_report.report_metrics(metrics, self.epoch, self.global_step, self.state.ledger, self.world_size)
        if checkpoint is None:
            checkpoint = self.options.checkpoint.at_report(self.epoch, self.global_step, self.progress.epochs_total,
                                                           self.progress.steps_per_epoch)
        if self.world_size > 1:  # one rank's own checkpoint (or True): every rank's state goes in
            checkpoint = ray_report.any_rank(bool(checkpoint), self.control_group)
        ray_report.report_to_ray(metrics, self.save_state if checkpoint else None, user_checkpoint)
        self.clock.restart()  # the report (a barrier) and what came before it: not step time

    def save_state(self, directory: Path) -> None:
        """Write raycomp's checkpoint files into ``directory`` (yours, before ``ray.train.report``),
        after :meth:`drain`: a run resumed from them goes on as this one does."""
        self.drain()
        save_state(self.parts(), directory)
        if self.rank == 0:
            self.save_shared(directory)

    def save_shared(self, directory: Path) -> None:
        """Rank 0's part of a checkpoint: the model (unless sharded), optimizer, scheduler, step."""
        save_shared(self.parts(), directory)

    def totals(self) -> dict[str, Any]:
        """Run totals over all ranks (a collective), after :meth:`merge_replicas`."""
        self.merge_replicas()
        self.log.flush()
        return ray_report.run_totals(self.parts(), self.clock, self.reporter.dropped, self.control_group)

    def send_final(self) -> None:
        """The statistics since the last boundary, waited for; a second call sends nothing."""
        self._send_statistics(final=True)

    def close(self) -> None:
        """Send the last statistics (if :meth:`send_final` has not) and release the thread and files."""
        self.send_final()
        self.log.close()
        self.state.close()

    def __enter__(self) -> TrainLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _value(loss: torch.Tensor | float) -> float:
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
