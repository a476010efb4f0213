"""Glue between a Ray Train training loop and compressed communication.

One :class:`Session` per worker. The loop stays ordinary PyTorch::

    session = Session(model, optimizer, scheduler, config=..., run_id=..., controller=handle, ...)
    for epoch in session.epochs():
        for x, y in batches(epoch, start=session.step_in_epoch):
            loss = loss_fn(session.model(x), y)
            loss.backward()
            session.step(loss, samples=len(y))     # guard, optimizer, control boundary
        session.end_epoch({"eval_accuracy": ...})  # report + checkpoint

What happens where:

* every step: all ranks all-gather a tiny control vector (non-finite flag, loss, worst
  compression error, plan digest). The :class:`~raycomp.guard.Guard` decides on it —
  identically on every rank — and a plan disagreement raises :class:`PlanMismatchError`.
* every ``interval_steps`` (a control boundary): each rank sends its
  :class:`~raycomp.plan.GradStats` to the controller fire-and-forget; rank 0 collects the
  answer to the plan poll it sent at the previous boundary (``ray.wait(timeout=0)``,
  never blocking) and broadcasts the newest plan; every rank installs it for the next
  step and the ranks verify they agree before any gradient moves under it.
* if the controller is unreachable, training goes on under the last plan and the outage
  is counted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raycomp.baselines import register_torch_hook
from raycomp.config import JobConfig
from raycomp.guard import Guard
from raycomp.hook import CompressionState, compression_hook
from raycomp.plan import GradStats, Plan

log = logging.getLogger("raycomp.session")

MAX_REPORTS_IN_FLIGHT = 8  # per rank; beyond it the next report is dropped (and counted)


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans: continuing would desynchronise the collectives."""


class Session:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        config: JobConfig,
        run_id: str,
        output_dir: str | Path,
        controller: Any = None,
        steps_per_epoch: int,
        initial_plan: Plan | None = None,
    ) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.config, self.run_id, self.controller = config, run_id, controller
        self.steps_per_epoch = steps_per_epoch
        self.interval = config.controller.interval_steps
        self.output_dir = Path(output_dir)
        self.model = ray.train.torch.prepare_model(model)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        compression = config.compression
        budget = compression.error_budget
        profile = tuple(sorted({*budget.ratios, budget.reference_ratio})) if compression.policy == "error_budget" else ()
        self.controller_plan = initial_plan or Plan(reason="warm-up: dense")
        self.state = CompressionState(
            self.model, self.controller_plan, memory=compression.memory,
            min_compress_numel=compression.min_compress_numel, seed=config.run.seed,
            stats_every=self.interval, profile_ratios=profile,
        )
        if self.ddp and compression.baseline_hook != "none":
            register_torch_hook(self.model, compression)  # raycomp stays out of the way
        elif self.ddp:
            self.model.register_comm_hook(self.state, compression_hook)
        # control messages always travel on gloo (CPU), whatever carries the gradients
        backend = dist.get_backend() if dist.is_initialized() else None
        self.control_group = dist.new_group(backend="gloo") if backend not in (None, "gloo") else None
        self.guard = Guard(**compression.guard.model_dump())
        self.global_step = 0
        self.epoch = 0
        self.plan_switches = 0
        self.outages = 0
        self.skipped_steps = 0
        self.replayed_steps = 0
        self.restored_from: int | None = None
        self.control_seconds = 0.0  # guard vector + boundaries: the controller's cost per rank
        self.stats_dropped = 0
        self.step_seconds = 0.0
        self._lr_ramp_from: int | None = None
        self._lr_used = 0.0
        self._poll: Any = None
        self._pending_ingest: list[Any] = []
        self._interval_loss: list[float] = []
        self._interval_time: list[tuple[float, float, int]] = []  # (step s, comm s, samples)
        self._comm_at_step_start = 0.0
        self._step_started = time.perf_counter()
        self._new_events: list[dict[str, Any]] = []
        self._eval_metric: float | None = None
        self.step_log = self.output_dir / "steps" / f"rank{self.rank}.jsonl"
        self.step_log.parent.mkdir(parents=True, exist_ok=True)
        self._restore()
        self._log_file = self.step_log.open("a")

    # --- the loop --------------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        start = self.global_step // self.steps_per_epoch
        for epoch in range(start, self.config.workload.epochs):
            self.epoch = epoch
            yield epoch

    @property
    def step_in_epoch(self) -> int:
        return self.global_step - self.epoch * self.steps_per_epoch

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        """Fault injection: a NaN loss (hence NaN gradients) at the configured step/rank."""
        faults = self.config.faults
        if faults.nan_at_step == self.global_step and faults.nan_rank == self.rank:
            return loss * float("nan")
        if faults.loss_scale_at_step == self.global_step:
            return loss * faults.loss_scale
        return loss

    def step(self, loss: torch.Tensor, samples: int) -> bool:
        """After ``loss.backward()``: guard, optimizer step (unless skipped), boundary.

        Returns whether the optimizer step was applied.
        """
        self._maybe_kill()
        if not self.ddp:
            self.state.allreduce_gradients()  # one process: local compression + memory
        loss_value = float(loss.detach())
        started = time.perf_counter()
        applied = self._guard_step(loss_value)
        self.control_seconds += time.perf_counter() - started
        self._lr_used = self.optimizer.param_groups[0]["lr"] * self._lr_factor()
        if applied:
            self._optimizer_step()
        else:
            self.skipped_steps += 1
            self.state.discard_step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self._finish_step(loss_value, samples, applied)
        return applied

    def _guard_step(self, loss: float) -> bool:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # one pass: NaN/Inf anywhere makes the global norm NaN/Inf
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) \
            if grads else 0.0
        nonfinite = bool(self.state.nonfinite_layers) or not math.isfinite(norm)
        fresh = self.state.stats_step == self.state.step - 1
        worst = max((s.compression_error for s in self.state.stats), default=-1.0) if fresh else -1.0
        plan = self.state.plan
        rows = self._all_gather_control([float(nonfinite), loss, worst, norm if math.isfinite(norm) else -1.0,
                                         *_digest_parts(plan)])
        if len({(r[_HI], r[_LO]) for r in rows}) > 1:
            raise PlanMismatchError(
                f"ranks hold different plans at step {self.global_step}: "
                + ", ".join(f"rank {i}: version {int(r[_VERSION])}" for i, r in enumerate(rows))
            )
        any_nonfinite = any(r[0] > 0 for r in rows)
        losses = [r[1] for r in rows]
        mean_loss = math.fsum(losses) / len(losses) if all(map(math.isfinite, losses)) else float("nan")
        errors = [r[2] for r in rows if r[2] >= 0]
        # the gradients are the same all-reduced mean on every rank: take rank 0's norm
        verdict = self.guard.observe(self.global_step, any_nonfinite, mean_loss,
                                     max(errors) if errors else None, max(rows[0][3], 0.0))
        if verdict.changed:
            event = self.guard.events[-1]
            self._new_events.append(event.to_dict())
            log.warning("guard %s at step %d: %s (%s)", event.kind, event.step, event.reason, event.detail)
            self._install(self.controller_plan)
        return not verdict.skip_update

    def _optimizer_step(self) -> None:
        factor = self._lr_factor()
        if factor != 1.0:
            saved = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] *= factor
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = lr
        else:
            self.optimizer.step()

    def _lr_factor(self) -> float:
        ramp = self.config.compression.lr_scaling
        if not ramp.enabled or self._lr_ramp_from is None:
            return 1.0
        done = (self.global_step - self._lr_ramp_from) / ramp.warmup_steps
        return 1.0 if done >= 1 else ramp.start_factor + (1 - ramp.start_factor) * done

    def _finish_step(self, loss: float, samples: int, applied: bool) -> None:
        now = time.perf_counter()
        comm = self.state.comm_seconds - self._comm_at_step_start
        self._interval_time.append((now - self._step_started, comm, samples))
        self._interval_loss.append(loss)
        plan = self.state.plan
        record = {
            "step": self.global_step, "epoch": self.epoch, "time": time.time(), "plan_version": plan.version,
            "plan_digest": plan.digest(), "dense": _is_dense(plan),
            "loss": loss, "lr": self._lr_used, "applied": applied, "fallback": self.guard.active,
            "wire_bytes": self.state.ledger.wire_total, "dense_bytes": self.state.ledger.dense_total,
        }
        self._log_file.write(json.dumps(record) + "\n")
        self.global_step += 1
        self.step_seconds += now - self._step_started
        if self.global_step % self.interval == 0:
            started = time.perf_counter()
            self._boundary()
            self.control_seconds += time.perf_counter() - started
        self._comm_at_step_start = self.state.comm_seconds
        self._step_started = time.perf_counter()

    # --- control boundary ---------------------------------------------------------------------
    def _boundary(self) -> None:
        self._log_file.flush()
        self._send_stats()
        new_plan = self._poll_controller() if self.rank == 0 else None
        new_plan = self._broadcast_plan(new_plan)
        if new_plan is not None and new_plan.version > self.controller_plan.version:
            self.controller_plan = new_plan
            self.plan_switches += 1
            self._install(new_plan)
        self._check_agreement()

    def _install(self, controller_plan: Plan) -> None:
        """Install the effective plan (the guard's dense override, or the controller's)."""
        if self.guard.active:
            plan = Plan(version=controller_plan.version, dense=True, reason=f"guard: {self.guard.reason}")
        else:
            plan = controller_plan
        previous = self.state.plan
        if _is_dense(previous) and not _is_dense(plan):
            self._lr_ramp_from = self.global_step  # compression (re)starts: ramp the LR
        self.state.set_plan(plan)

    def _send_stats(self, final: bool = False) -> None:
        timings, losses = self._interval_time, self._interval_loss
        self._interval_time, self._interval_loss = [], []
        if self.controller is None:
            return
        if not timings:  # nothing new since the last boundary
            if final:
                self._reap_ingests(wait_s=10)
            return
        self._reap_ingests()
        if len(self._pending_ingest) >= MAX_REPORTS_IN_FLIGHT and not final:
            # backpressure: a controller that falls behind must not queue without bound
            self.stats_dropped += 1
            if self.stats_dropped in (1, 10, 100):
                log.warning("controller is behind: %d statistics reports dropped", self.stats_dropped)
            return
        step_s = sum(t for t, _, _ in timings) / len(timings)
        comm_s = sum(c for _, c, _ in timings) / len(timings)
        finite = [v for v in losses if math.isfinite(v)]
        stats = GradStats(
            run_id=self.run_id, rank=self.rank, step=self.global_step - 1, epoch=self.epoch,
            plan_version=self.state.plan.version,
            loss=math.fsum(finite) / len(finite) if finite else 0.0,
            step_seconds=step_s, compute_seconds=max(0.0, step_s - comm_s), comm_seconds=comm_s,
            samples_per_second=sum(n for _, _, n in timings) / max(1e-9, sum(t for t, _, _ in timings)),
            wire_bytes=self.state.ledger.wire_total, dense_bytes=self.state.ledger.dense_total,
            fallback_active=self.guard.active,
            layers=tuple(s.to_dict() for s in self.state.stats if _finite_stats(s)),
            events=tuple(self._new_events), eval_metric=self._eval_metric, outages=self.outages,
        )
        self._new_events = []
        self._eval_metric = None
        try:
            ref = self.controller.ingest.remote(stats.to_dict())
            self._pending_ingest.append(ref)
            if final:  # the process may exit next: make sure the last totals arrive
                import ray

                ray.get(ref, timeout=10)
        except Exception as error:  # noqa: BLE001 - the controller is optional at run time
            self._outage(error)

    def _reap_ingests(self, wait_s: float = 0) -> None:
        import ray

        if not self._pending_ingest:
            return
        ready, waiting = ray.wait(self._pending_ingest, num_returns=len(self._pending_ingest), timeout=wait_s)
        self._pending_ingest = waiting
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:  # noqa: BLE001
                self._outage(error)

    def _poll_controller(self) -> Plan | None:
        import ray

        if self.controller is None:
            return None
        plan = None
        if self._poll is not None:
            ready, _ = ray.wait([self._poll], timeout=0)
            if not ready:
                return None  # still in flight: never wait for it
            try:
                answer = ray.get(self._poll)
                plan = None if answer is None else Plan.from_dict(answer)
            except Exception as error:  # noqa: BLE001
                self._outage(error)
            self._poll = None
        try:
            # a long poll: answers as soon as a newer plan exists; checked, never awaited
            self._poll = self.controller.plan.remote(self.run_id, self.controller_plan.version, 30.0)
        except Exception as error:  # noqa: BLE001
            self._outage(error)
        return plan

    def _outage(self, error: BaseException) -> None:
        self.outages += 1
        if self.outages == 1 or self.outages % 100 == 0:
            log.warning("controller unreachable (%d so far); training continues on plan %d: %s",
                        self.outages, self.state.plan.version, error)

    def _broadcast_plan(self, plan: Plan | None) -> Plan | None:
        if self.world_size == 1:
            return plan
        if self.rank == 0 and plan is not None:
            data = torch.frombuffer(bytearray(plan.to_json().encode()), dtype=torch.uint8)
        else:
            data = torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control_group)
        if int(size) == 0:
            return None
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control_group)
        return Plan.from_json(bytes(data.tolist()).decode())

    def _check_agreement(self) -> None:
        faults = self.config.faults
        if faults.force_plan_mismatch_at_step is not None and self.rank == self.world_size - 1 \
                and self.global_step >= faults.force_plan_mismatch_at_step:
            self.state.set_plan(self.state.plan.with_version(self.state.plan.version + 1000))
        plan = self.state.plan
        rows = self._all_gather_control([0.0, 0.0, 0.0, 0.0, *_digest_parts(plan)])
        if len({(r[_HI], r[_LO]) for r in rows}) > 1:
            raise PlanMismatchError(
                f"ranks disagree on the plan installed for step {self.global_step}: "
                + ", ".join(f"rank {i}: version {int(r[_VERSION])}" for i, r in enumerate(rows))
                + "; refusing to communicate under different plans"
            )

    def _all_gather_control(self, values: list[float]) -> list[list[float]]:
        row = torch.tensor(values, dtype=torch.float64)
        if self.world_size == 1:
            return [row.tolist()]
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row, group=self.control_group)
        return [r.tolist() for r in rows]

    # --- epochs, checkpoints ----------------------------------------------------------------
    def end_epoch(self, metrics: dict[str, Any], eval_metric: float | None = None) -> None:
        """Report ``metrics``; every ``checkpoint.every_epochs`` epochs with a checkpoint."""
        import ray.train

        self._eval_metric = eval_metric
        self._log_file.flush()
        if self.rank == 0:  # accuracy over wall time, for time-to-target measurements
            with (self.output_dir / "evals.jsonl").open("a") as evals:
                evals.write(json.dumps({"time": time.time(), **metrics, "epoch": self.epoch,
                                        "step": self.global_step}) + "\n")
        ledger = self.state.ledger
        metrics = {**metrics, "epoch": self.epoch, "step": self.global_step,
                   "wire_bytes": ledger.wire_total * self.world_size,  # rank 0's, scaled to all ranks
                   "dense_bytes": ledger.dense_total * self.world_size,
                   "compression_ratio": ledger.compression_ratio or 1.0}
        last = self.epoch + 1 == self.config.workload.epochs
        if (self.epoch + 1) % self.config.checkpoint.every_epochs and not last:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="raycomp-ckpt-") as tmp:
            self._save(Path(tmp))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        # Ray Train registers a reported checkpoint asynchronously; a worker dying before
        # that loses it and a restart would begin from scratch. Wait until it is registered.
        ray.train.get_all_reported_checkpoints()

    def _save(self, directory: Path) -> None:
        own = {
            "compression": self.state.state_dict(), "guard": self.guard.state_dict(),
            "controller_plan": self.controller_plan.to_dict(), "rng": torch.get_rng_state(),
            "counters": {"plan_switches": self.plan_switches, "outages": self.outages,
                         "skipped_steps": self.skipped_steps, "lr_ramp_from": self._lr_ramp_from},
        }
        _atomic_save(own, directory / f"rank{self.rank}.pt")
        if self.rank == 0 and self.config.faults.crash_while_checkpointing_epoch == self.epoch:
            self._crash_once(f"checkpoint-{self.epoch}")  # half-written: rank0.pt without shared.pt
        if self.rank == 0:
            module = getattr(self.model, "module", self.model)
            shared = {
                "model": module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            }
            _atomic_save(shared, directory / "shared.pt")
            meta = {"global_step": self.global_step, "epoch": self.epoch, "world_size": self.world_size}
            (directory / "meta.json").write_text(json.dumps(meta))

    def _restore(self) -> None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            self.step_log.write_text("")
            return
        with checkpoint.as_directory() as directory:
            directory = Path(directory)
            meta = json.loads((directory / "meta.json").read_text())
            shared = torch.load(directory / "shared.pt", weights_only=False)
            getattr(self.model, "module", self.model).load_state_dict(shared["model"])
            self.optimizer.load_state_dict(shared["optimizer"])
            if self.scheduler is not None and shared["scheduler"] is not None:
                self.scheduler.load_state_dict(shared["scheduler"])
            own_path = directory / f"rank{self.rank}.pt"
            if meta["world_size"] == self.world_size and own_path.exists():
                own = torch.load(own_path, weights_only=False)
                self.state.load_state_dict(own["compression"])
                self.guard.load_state_dict(own["guard"])
                self.controller_plan = Plan.from_dict(own["controller_plan"])
                torch.set_rng_state(own["rng"])
                counters = own["counters"]
                self.plan_switches, self.outages = counters["plan_switches"], counters["outages"]
                self.skipped_steps, self._lr_ramp_from = counters["skipped_steps"], counters["lr_ramp_from"]
            else:
                log.warning("checkpoint is from %d workers, now %d: compression state starts fresh",
                            meta["world_size"], self.world_size)
        self.global_step = meta["global_step"]
        self.restored_from = self.global_step
        self.replayed_steps = _truncate_log(self.step_log, self.global_step)
        log.info("resumed from step %d (%d logged steps after it are replayed)",
                 self.global_step, self.replayed_steps)

    def _maybe_kill(self) -> None:
        faults = self.config.faults
        if faults.hang_rank_at_step == self.global_step and faults.hang_rank == self.rank:
            log.warning("fault injection: rank %d stops communicating at step %d", self.rank, self.global_step)
            time.sleep(24 * 3600)  # the others' next collective must time out, not wait forever
        if faults.kill_rank_at_step != self.global_step or faults.kill_rank != self.rank:
            return
        self._crash_once(f"killed-at-{self.global_step}")

    def _crash_once(self, name: str) -> None:
        marker = self.output_dir / "faults" / name
        if marker.exists():
            return  # the injected fault already happened; the restarted run goes on
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        self._log_file.flush()
        log.warning("fault injection: rank %d crashes (%s)", self.rank, name)
        os._exit(17)  # a crash, not an exception: no cleanup, like a killed process

    # --- the end ------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Run totals over all ranks (a collective: call on every rank)."""
        sums = torch.tensor([self.state.ledger.wire_total, self.state.ledger.dense_total,
                             float(self.outages)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(sums, group=self.control_group)
        self._log_file.flush()
        return {
            "wire_bytes_total": float(sums[0]), "dense_bytes_total": float(sums[1]),
            "controller_outages": int(sums[2]), "steps": self.global_step,
            "stats_dropped": self.stats_dropped,
            "plan_switches": self.plan_switches, "skipped_steps": self.skipped_steps,
            "fallback_events": [e.to_dict() for e in self.guard.events],
            "replayed_steps": self.replayed_steps, "restored_from_step": self.restored_from,
            "final_plan": self.state.plan.to_dict(),
            "control_seconds": self.control_seconds,
            "control_overhead": self.control_seconds / self.step_seconds if self.step_seconds else 0.0,
        }

    def close(self) -> None:
        """Send the last statistics (final byte totals) and release resources."""
        self._send_stats(final=True)
        self._log_file.close()
        self.state.close()


# positions in the control vector: [nonfinite, loss, worst error, grad norm, digest hi, lo, version]
_HI, _LO, _VERSION = 4, 5, 6


def _digest_parts(plan: Plan) -> list[float]:
    digest = plan.digest()  # 63 bits: two exact float64 halves, plus the version for messages
    return [float(digest >> 32), float(digest & 0xFFFFFFFF), float(plan.version)]


def _is_dense(plan: Plan) -> bool:
    return plan.dense or (plan.default.is_dense and all(s.is_dense for _, s in plan.layers))


def _finite_stats(stats: Any) -> bool:
    values = (stats.grad_norm, stats.compression_error, stats.residual_norm)
    return all(math.isfinite(v) for v in values)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _truncate_log(path: Path, next_step: int) -> int:
    """Keep log records of steps before ``next_step``; return how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a line cut short by the crash
            continue
        if record["step"] < next_step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(line + "\n" for line in kept))
    return dropped
