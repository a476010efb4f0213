"""The control loop of one worker, composed of small parts.

Per step (the hot path): the DDP hook has reduced the gradients (compressed as the plan
says, with the guard's control rows riding inside the last collective); the guard decides
from the reduced gradient and those rows (:mod:`raycomp.train.guard_step`); the optimizer
steps unless the guard skips; the step is logged. Nothing else talks to other ranks.

Every ``interval_steps`` (a control boundary): statistics go to the controller
(:mod:`raycomp.train.reporter`), the ranks prove they hold the same plan and guard state,
and rank 0's newest plan is broadcast and installed for the next step
(:mod:`raycomp.train.plan_sync`). Every ``checkpoint.every_steps`` steps, and at epoch
ends, the model, optimizer and every rank's compression state go into a Ray Train
checkpoint (:mod:`raycomp.train.checkpoint`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raycomp.baselines import register_torch_hook
from raycomp.buckets import ddp_kwargs
from raycomp.guard import Guard
from raycomp.hook import CompressionState, compression_hook
from raycomp.loss_scale import check_scaler, unscale_once
from raycomp.plan import Plan
from raycomp.train import checkpoint
from raycomp.train.guard_step import GuardStep
from raycomp.train.lossy import lossy_options
from raycomp.train.lr_ramp import LrRamp
from raycomp.train.options import TrainOptions
from raycomp.train.plan_sync import PlanSync
from raycomp.train.reporter import Outages, StatsReporter
from raycomp.train.step_log import StepLog

log = logging.getLogger("raycomp.train")


class TrainLoop:
    """raycomp inside one Ray Train worker; built by :func:`raycomp.train.prepare_model`.

    Holds a thread (the hook's communication thread) and a log file: use it as a context
    manager or call :meth:`finish`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *,
                 options: TrainOptions, controller: Any = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        import ray.train
        import ray.train.torch

        # prepare_model, the only caller, has refused a scaler this loop cannot follow.
        # A disabled scaler (GradScaler(enabled=False), common behind a flag) scales nothing
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.sharded = options.strategy == "fsdp"
        if self.sharded:  # FSDP2; the menu: what a reduce-scatter row can carry
            from raycomp.sharded_state import ShardedState
            from raycomp.train.sharding import shard_model, sharded_options

            options = sharded_options(options)
        options = lossy_options(options, optimizer)  # "auto": the optimizer decides
        self.options, self.interval = options, options.controller.interval_steps
        self.run_id = options.run_id or context.get_experiment_name()
        self.output_dir = Path(options.output_dir or Path(tempfile.gettempdir()) / "raycomp" / self.run_id)
        c = options.compression
        if self.sharded:
            self.model = shard_model(model, optimizer, ray.train.torch.get_device(),
                                     torch.bfloat16 if c.baseline_hook == "torch_fsdp_bf16" else None)
        else:
            ddp_options = ddp_kwargs(c, model)
            if options.find_unused_parameters:
                ddp_options["find_unused_parameters"] = True
            self.model = ray.train.torch.prepare_model(model, parallel_strategy_kwargs=ddp_options)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        module = getattr(self.model, "module", self.model)
        self._params = [p for p in module.parameters() if p.requires_grad]
        # control messages always travel on gloo (CPU), whatever carries the gradients
        backend = dist.get_backend() if dist.is_initialized() else None
        group = dist.new_group(backend="gloo") if backend not in (None, "gloo") else None
        self.control_group = group
        profile = tuple(sorted({*c.error_budget.ratios, c.error_budget.reference_ratio})) \
            if c.policy == "error_budget" else ()
        self.state: Any
        if self.sharded:
            self.state = ShardedState(self.model, Plan(), min_compress_numel=c.min_compress_numel, seed=options.seed,
                                      stats_every=self.interval, error_feedback=c.memory != "none",
                                      install=c.baseline_hook == "none",  # else FSDP's own reduce-scatter
                                      control_group=group)
        else:
            self.state = CompressionState(self.model, Plan(), memory=c.memory, min_compress_numel=c.min_compress_numel,
                                          seed=options.seed, stats_every=self.interval, profile_ratios=profile,
                                          grad_scaler=self.grad_scaler)
        if self.ddp and c.baseline_hook != "none":
            register_torch_hook(self.model, c)  # raycomp stays out of the way
        elif self.ddp:
            self.model.register_comm_hook(self.state, compression_hook)
        outages = Outages()
        self.outages = outages
        self.plans = PlanSync(self.rank, self.world_size, group, controller, self.run_id, outages)
        self.guard = GuardStep(Guard(**c.guard.model_dump()), self.state, self.rank, self.world_size, group,
                               self.grad_scaler)
        self.reporter = StatsReporter(controller, self.run_id, self.rank, outages)
        self.log = StepLog(self.output_dir, self.rank, options.progress_every)
        self.global_step = self.epoch = self.plan_switches = self.skipped_steps = 0
        self.steps_per_epoch: int | None = None
        self.epochs_total: int | None = None
        self.restored_from: int | None = None
        self.control_seconds = self.step_seconds = 0.0  # the controller's share of a rank's time
        self.boundary_seconds = 0.0  # the part of control_seconds spent at boundaries
        self.lr_ramp = LrRamp(c.lr_scaling)
        self._lr_used = 0.0
        # shapes, not element counts: the adaptive policy sizes PowerSGD's factors from them
        layers = ({name: [numel] for name, numel in self.state.sizes.items()} if self.sharded
                  else {name: list(p.shape) for name, p in module.named_parameters() if p.requires_grad})
        self.controller_plan = self.plans.register(layers, options, options.eval_kind)
        self.state.set_plan(self.controller_plan)
        self._restore()
        self.replayed_steps = self.log.open(self.restored_from)
        self._restart_step_clock()

    # --- the loop ---------------------------------------------------------------------------
    def epochs(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        """Epoch numbers still to train (a resumed run starts mid-way; see :attr:`step_in_epoch`)."""
        self.epochs_total, self.steps_per_epoch = epochs, steps_per_epoch
        for epoch in range(self.global_step // steps_per_epoch, epochs):
            self.epoch = epoch
            yield epoch

    @property
    def step_in_epoch(self) -> int:
        """The first batch of the current epoch still to train."""
        return self.global_step - self.epoch * (self.steps_per_epoch or 0)

    def step(self, loss: torch.Tensor, samples: int = 0) -> bool:
        """After ``loss.backward()``: guard, optimizer step (unless skipped), boundary.
        Returns whether the optimizer step was applied."""
        if self.sharded:
            self.state.end_backward()  # FSDP reduce-scattered in backward; close the step
        elif not self.ddp:
            self.state.allreduce_gradients()  # one process: local compression + memory
        loss_value = float(loss.detach())
        started = time.perf_counter()
        if self.grad_scaler is not None:  # the guard judges the gradient itself
            unscale_once(self.grad_scaler, self.optimizer)
        verdict = self.guard.decide(self.global_step, self._params)
        if verdict.changed:
            event = self.guard.guard.events[-1]
            self.reporter.events.append(event.to_dict())
            log.warning("guard %s at step %d: %s (%s)", event.kind, event.step, event.reason, event.detail)
            self._install(self.controller_plan)
        applied = not verdict.skip_update
        self.guard.stage(loss_value, applied)
        self.control_seconds += time.perf_counter() - started
        self._lr_used = self.optimizer.param_groups[0]["lr"] * self.lr_ramp.factor(self.global_step)
        # with a scaler the gradients are unscaled and finite here: its step() would do no more
        if applied:
            self.lr_ramp.optimizer_step(self.optimizer, self.global_step)
        else:
            self.skipped_steps += 1
            self.state.discard_step()
        if self.grad_scaler is not None:
            self.grad_scaler.update()  # backs off after an overflow, grows after clean steps
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self._finish_step(loss_value, samples, applied)
        return applied

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
        if self.global_step % self.interval == 0:
            started = time.perf_counter()
            self._boundary()
            self.boundary_seconds += time.perf_counter() - started
            self.control_seconds += time.perf_counter() - started
        every = self.options.checkpoint.every_steps
        epoch_end = bool(self.steps_per_epoch) and self.global_step % self.steps_per_epoch == 0  # type: ignore[operator]
        if every and self.global_step % every == 0 and not epoch_end:
            self.report({}, checkpoint=True)  # the epoch's own report checkpoints epoch ends
        self._restart_step_clock()

    def _restart_step_clock(self) -> None:
        """The next step's time (and its communication share) counts from now. Called after
        a step, and after an evaluation or a report: their time is not a step's, and counting
        it would inflate the compute time the adaptive policy's cost model works from (an
        evaluation every 20 steps made it 2-4x the real one on the CNN benchmark)."""
        self._comm_at_step_start = self.state.comm_seconds
        self._step_started = time.perf_counter()

    # --- control boundary -------------------------------------------------------------------
    def _boundary(self) -> None:
        self.log.flush()
        self.reporter.send(self.state, self.global_step - 1, self.epoch, self.guard.guard.active,
                           **self._skips())
        new_plan = self.sync_plan(self.plans.poll(self.controller_plan.version))
        if new_plan is not None and new_plan.version > self.controller_plan.version:
            self.controller_plan = new_plan
            self.plan_switches += 1
            self._install(new_plan)

    def _skips(self) -> dict[str, Any]:
        """Skipped steps so far and the loss scale, for the controller's report."""
        scale = None if self.grad_scaler is None else self.grad_scaler.get_scale()
        return {"skipped_steps": self.skipped_steps, "loss_scale": scale}

    def sync_plan(self, offer: Plan | None) -> Plan | None:
        """Agreement check of plan and guard state; rank 0's ``offer`` on every rank."""
        guard = self.guard.guard
        state = (float(self.skipped_steps), float(guard.active), float(len(guard.events)))
        return self.plans.sync(self.state.plan, state, offer, self.global_step)

    def _install(self, controller_plan: Plan) -> None:
        """Install the effective plan (the guard's dense override, or the controller's)."""
        guard = self.guard.guard
        plan = Plan(version=controller_plan.version, dense=True, reason=f"guard: {guard.reason}") \
            if guard.active else controller_plan
        if _is_dense(self.state.plan) and not _is_dense(plan):
            self.lr_ramp.started_at = self.global_step  # compression (re)starts: ramp the LR
        self.state.set_plan(plan)

    # --- evaluations, reports, checkpoints ---------------------------------------------------
    def record_eval(self, metrics: dict[str, float], value: float | None = None) -> None:
        """An evaluation: one line in rank 0's ``evals.jsonl``; ``value`` goes to the controller."""
        self.log.write_eval(metrics, self.global_step, self.epoch)
        self.reporter.eval_metric = value
        self._restart_step_clock()  # the evaluation ran since the last step: not step time

    def report(self, metrics: dict[str, Any], checkpoint: bool | None = None) -> None:
        """``ray.train.report`` (a barrier on all ranks) with byte totals added; with a
        checkpoint when asked, or (None) at the epoch ends ``checkpoint.every_epochs`` names."""
        import ray.train

        self.log.flush()
        ledger = self.state.ledger
        metrics = {**metrics, "epoch": self.epoch, "step": self.global_step,
                   "wire_bytes": ledger.wire_total * self.world_size,  # rank 0's, scaled to all ranks
                   "dense_bytes": ledger.dense_total * self.world_size,
                   "compression_ratio": ledger.compression_ratio or 1.0}
        if checkpoint is None:
            last = self.epochs_total is not None and self.epoch + 1 == self.epochs_total
            checkpoint = last or (self.epoch + 1) % self.options.checkpoint.every_epochs == 0
        if not checkpoint:
            ray.train.report(metrics)
        else:
            with tempfile.TemporaryDirectory(prefix="raycomp-ckpt-") as tmp:
                self.save_state(Path(tmp))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            # Ray Train registers a reported checkpoint asynchronously; a worker dying before
            # that loses it and a restart would begin from scratch. Wait until it is registered.
            ray.train.get_all_reported_checkpoints()
        self._restart_step_clock()  # the report (a barrier) and what came before it: not step time

    def save_state(self, directory: Path) -> None:
        """Write raycomp's checkpoint files into ``directory`` (yours, before ``ray.train.report``)."""
        checkpoint.save_own(directory, self.rank, {
            "compression": self.state.state_dict(), "guard": self.guard.state_dict(),
            "controller_plan": self.controller_plan.to_dict(), "rng": torch.get_rng_state(),
            "counters": {"plan_switches": self.plan_switches, "outages": self.outages.count,
                         "skipped_steps": self.skipped_steps, "lr_ramp_from": self.lr_ramp.started_at,
                         "loss_scale_overflows": self.guard.overflows},
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        })
        if self.sharded:  # every rank writes its shards (a collective)
            checkpoint.save_sharded(directory, self.model, self.optimizer)
        if self.rank == 0:
            self.save_shared(directory)

    def save_shared(self, directory: Path) -> None:
        meta = {"global_step": self.global_step, "epoch": self.epoch, "world_size": self.world_size}
        checkpoint.save_shared(directory, None if self.sharded else self.model, self.optimizer, self.scheduler, meta)

    def _restore(self) -> None:
        import ray.train

        found = ray.train.get_checkpoint()
        if found is None:
            return
        with found.as_directory() as directory:
            if not (Path(directory) / checkpoint.META).exists():
                log.warning("the checkpoint holds no raycomp state: starting fresh")
                return
            meta, own = checkpoint.load(Path(directory), self.rank, self.world_size, self.model,
                                        self.optimizer, self.scheduler, sharded=self.sharded)
            if own is None:
                log.warning("checkpoint is from %d workers, now %d: compression state starts fresh",
                            meta["world_size"], self.world_size)
            else:
                self.state.load_state_dict(own["compression"])
                self.guard.load_state_dict(own["guard"])
                self.controller_plan = Plan.from_dict(own["controller_plan"])
                torch.set_rng_state(own["rng"])
                counters = own["counters"]
                self.plan_switches, self.outages.count = counters["plan_switches"], counters["outages"]
                self.skipped_steps, self.lr_ramp.started_at = counters["skipped_steps"], counters["lr_ramp_from"]
                self.guard.overflows = counters.get("loss_scale_overflows", 0)
                if self.grad_scaler is not None and own.get("grad_scaler"):
                    self.grad_scaler.load_state_dict(own["grad_scaler"])
        self.global_step = self.restored_from = meta["global_step"]
        log.info("resumed from step %d", self.global_step)

    # --- the end ------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Run totals over all ranks (a collective: call on every rank)."""
        sums = torch.tensor([self.state.ledger.wire_total, self.state.ledger.dense_total,
                             float(self.outages.count)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(sums, group=self.control_group)
        self.log.flush()
        return {
            "wire_bytes_total": float(sums[0]), "dense_bytes_total": float(sums[1]),
            "controller_outages": int(sums[2]), "steps": self.global_step, "stats_dropped": self.reporter.dropped,
            "plan_switches": self.plan_switches, "skipped_steps": self.skipped_steps,
            "loss_scale_overflows": self.guard.overflows,
            "fallback_events": [e.to_dict() for e in self.guard.guard.events],
            "replayed_steps": self.replayed_steps, "restored_from_step": self.restored_from,
            "final_plan": self.state.plan.to_dict(), "control_seconds": self.control_seconds,
            "control_boundary_seconds": self.boundary_seconds,
            "control_overhead": self.control_seconds / self.step_seconds if self.step_seconds else 0.0,
            # what DDP was built with (compression.bucket_cap_mb); None without DDP (FSDP, 1 worker)
            "ddp_bucket_cap_mb": self.model.bucket_bytes_cap / 2**20 if self.ddp else None,
        }

    def close(self) -> None:
        """Send the last statistics (final byte totals) and release the thread and files."""
        self.reporter.send(self.state, self.global_step - 1, self.epoch, self.guard.guard.active, final=True,
                           **self._skips())
        self.log.close()
        self.state.close()

    def __enter__(self) -> TrainLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refuse_scaler(grad_scaler: Any, options: TrainOptions) -> None:
    """A one-line error for a GradScaler raycomp.train cannot follow."""
    check_scaler(grad_scaler)
    if grad_scaler is not None and grad_scaler.is_enabled() and options.strategy == "fsdp":
        raise ValueError("grad_scaler: not supported with strategy 'fsdp'; allowed there: None "
                         "(train in bf16, which needs no loss scaling)")


def _is_dense(plan: Plan) -> bool:
    return plan.dense or (plan.default.is_dense and all(s.is_dense for _, s in plan.layers))
