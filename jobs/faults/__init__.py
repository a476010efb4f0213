"""Fault injection for tests and drills, wrapped around a :class:`~raycomp.train.TrainLoop`.

Not part of a production config: ``faults.*`` is a section of :class:`DrillConfig` only,
the job config of a fault drill (``python -m jobs.faults``, same arguments as
``python -m jobs.train``; the tests load it the same way). When ``faults.*`` is set, the
job builds a :class:`FaultInjector` and lets it wrap the loop's methods and the loss
function; the production step never looks at fault settings::

    injector = FaultInjector(config.faults, rank, output_dir)
    injector.install(loop)               # kill/hang before a step, plan mismatch, crash mid-save,
                                         # a slow evaluation
    loss_fn = injector.wrap_loss(loss_fn, lambda: loop.global_step)   # NaN / spike
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field, model_validator

from jobs.config import JobConfig
from jobs.config.job_sections import Section

__all__ = ["DrillConfig", "FaultInjector", "FaultsSection"]

log = logging.getLogger("jobs.faults")


class FaultsSection(Section):
    """Fault injection for tests and drills; all off by default."""

    nan_at_step: Annotated[int | None, Field(ge=0)] = None
    nan_rank: Annotated[int, Field(ge=0)] = 0
    kill_rank_at_step: Annotated[int | None, Field(ge=0)] = None
    kill_rank: Annotated[int, Field(ge=0)] = 0
    force_plan_mismatch_at_step: Annotated[int | None, Field(ge=0)] = None
    loss_scale_at_step: Annotated[int | None, Field(ge=0)] = None  # multiply the loss: a spike
    loss_scale: Annotated[float, Field(gt=0)] = 100.0
    hang_rank_at_step: Annotated[int | None, Field(ge=0)] = None  # that rank stops communicating
    hang_rank: Annotated[int, Field(ge=0)] = 0
    #: how long it stays silent (an outage of its link), once: beyond scaling.collective_timeout_s
    #: the others' collective times out and the run restarts from its checkpoint
    hang_seconds: Annotated[float, Field(gt=0)] = 24 * 3600.0
    crash_while_checkpointing_epoch: Annotated[int | None, Field(ge=0)] = None  # rank 0, once
    slow_eval_seconds: Annotated[float, Field(ge=0)] = 0.0  # every evaluation takes this much longer
    slow_report_seconds: Annotated[float, Field(ge=0)] = 0.0  # every report takes this much longer


class DrillConfig(JobConfig):
    """A job config with a ``faults`` section: what a fault drill loads."""

    faults: FaultsSection = FaultsSection()

    @model_validator(mode="after")
    def _ranks_exist(self) -> DrillConfig:
        workers = self.scaling.num_workers
        for key in ("nan_rank", "kill_rank", "hang_rank"):
            if getattr(self.faults, key) >= workers:
                raise ValueError(f"faults.{key} must be < scaling.num_workers ({workers})")
        return self



class FaultInjector:
    """Args:
        faults: which faults, at which step and rank (all off by default).
        rank: this worker's rank.
        output_dir: where "already happened" markers go, so that a restarted run goes on.
    """

    def __init__(self, faults: FaultsSection, rank: int, output_dir: Path) -> None:
        self.faults, self.rank, self.output_dir = faults, rank, Path(output_dir)

    def install(self, loop: Any) -> None:
        f = self.faults
        if f.kill_rank_at_step is not None or f.hang_rank_at_step is not None:
            original_step = loop.step

            @functools.wraps(original_step)
            def step(loss: torch.Tensor, samples: int = 0, clip_grad_norm: float | None = None) -> bool:
                self.before_step(loop.global_step, loop)
                return original_step(loss, samples, clip_grad_norm)

            loop.step = step
        if f.force_plan_mismatch_at_step is not None and self.rank == loop.world_size - 1:
            original_sync = loop.agree_on_plan

            def agree_on_plan() -> Any:
                if loop.global_step >= f.force_plan_mismatch_at_step:
                    loop.state.set_plan(loop.state.plan.with_version(loop.state.plan.version + 1000))
                return original_sync()

            loop.agree_on_plan = agree_on_plan
        if f.crash_while_checkpointing_epoch is not None and self.rank == 0:
            original_shared = loop.save_shared

            def save_shared(directory: Path) -> None:
                if loop.epoch == f.crash_while_checkpointing_epoch:
                    self.crash_once(f"checkpoint-{loop.epoch}", loop)  # rank0.pt written, shared.pt not
                original_shared(directory)

            loop.save_shared = save_shared
        if f.slow_eval_seconds:
            original_eval = loop.record_eval

            def record_eval(metrics: dict[str, float], value: float | None = None) -> None:
                time.sleep(f.slow_eval_seconds)  # as if the evaluation before this call took longer
                original_eval(metrics, value)

            loop.record_eval = record_eval
        if f.slow_report_seconds:
            original_report = loop.report

            def report(metrics: dict[str, Any], checkpoint: bool | None = None) -> None:
                time.sleep(f.slow_report_seconds)  # as if the barrier waited this long for a peer
                original_report(metrics, checkpoint)

            loop.report = report

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor], global_step: Callable[[], int]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` whose loss is NaN (hence NaN gradients) or scaled at the configured step."""
        f = self.faults

        def poisoned(*args: Any) -> torch.Tensor:
            loss, step = loss_fn(*args), global_step()
            if f.nan_at_step == step and f.nan_rank == self.rank:
                return loss * float("nan")
            if f.loss_scale_at_step == step:
                return loss * f.loss_scale
            return loss

        return poisoned

    def before_step(self, step: int, loop: Any) -> None:
        f = self.faults
        if f.hang_rank_at_step == step and f.hang_rank == self.rank and self.once(f"hang-at-{step}"):
            log.warning("fault injection: rank %d stops communicating at step %d for %.0f s",
                        self.rank, step, f.hang_seconds)
            time.sleep(f.hang_seconds)  # longer than the timeout: the others' collective must time out
        if f.kill_rank_at_step == step and f.kill_rank == self.rank:
            self.crash_once(f"killed-at-{step}", loop)

    def once(self, name: str) -> bool:
        """Whether the fault ``name`` has not happened yet in this run (and mark it happened):
        a restarted run goes on past it."""
        marker = self.output_dir / "faults" / name
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
        return True

    def crash_once(self, name: str, loop: Any) -> None:
        if not self.once(name):
            return  # the injected fault already happened; the restarted run goes on
        loop.log.flush()
        log.warning("fault injection: rank %d crashes (%s)", self.rank, name)
        os._exit(17)  # a crash, not an exception: no cleanup, like a killed process
