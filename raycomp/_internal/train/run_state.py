"""A rank's run, typed: where it stands (:class:`Progress`), its time (:class:`StepClock`),
and the parts that a checkpoint saves and restores and the run's totals read
(:class:`RankParts`), which :class:`~raycomp.train.TrainLoop` hands
:mod:`raycomp._internal.train.resume` and :mod:`raycomp._internal.train.ray_report` so that
neither reads the loop itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from raycomp._internal.train.lr_ramp import LrRamp
from raycomp._internal.train.plan_handoff import PlanHandoff
from raycomp._internal.train.preemption import PreemptionWatch
from raycomp._internal.train.reporter import Outages
from raycomp._internal.train.step_judge import StepJudge

if TYPE_CHECKING:  # the protocols' module is the public package's, which imports the loop
    from raycomp._internal.train.gradient_strategy import GradientState, GradientStrategy

__all__ = ["InProgress", "Progress", "RankParts", "StepClock"]


@dataclass
class Progress:
    """Where the run stands on this rank, and what became of its steps."""

    global_step: int = 0  #: steps taken (a resumed run: from its checkpoint's)
    epoch: int = 0
    steps_per_epoch: int | None = None
    epochs_total: int | None = None
    #: the step count at which training ends, where known (``loop.epochs`` sets it; the
    #: framework integrations from the trainer's budget): that last step merges local
    #: steps' replicas, before what evaluates and saves the model
    last_step: int | None = None
    restored_from: int | None = None  #: the step a resume started at (None: a fresh start)
    replayed_steps: int = 0  #: logged steps after the checkpoint, trained again after a resume
    skipped_steps: int = 0  #: steps the guard skipped, on every rank alike
    local_skips: int = 0  #: inner steps this rank skipped on its own (local steps)
    outer_steps: int = 0  #: syncs of local steps whose outer step was applied (every rank alike)

    def epochs(self, epochs: int, steps_per_epoch: int) -> Iterator[int]:
        """Epoch numbers still to train (a resumed run starts mid-way: :attr:`step_in_epoch`)."""
        self.epochs_total, self.steps_per_epoch = epochs, steps_per_epoch
        self.last_step = epochs * steps_per_epoch
        for epoch in range(self.global_step // steps_per_epoch, epochs):
            self.epoch = epoch
            yield epoch

    @property
    def step_in_epoch(self) -> int:
        """The first batch of the current epoch still to train."""
        return self.global_step - self.epoch * (self.steps_per_epoch or 0)


class StepClock:
    """A rank's time: each step's own (with its communication share), and the controller's
    share of the run (``control_seconds``, of which ``boundary_seconds`` at boundaries)."""

    def __init__(self, state: GradientState) -> None:
        self.state = state
        self.control_seconds = self.step_seconds = self.boundary_seconds = 0.0
        self.restart()

    def restart(self) -> None:
        """The next step's time (and its communication share) counts from now. Called after
        a step, and after an evaluation or a report: their time is not a step's, and counting
        it would inflate the compute time the adaptive policy's cost model works from (by
        several times, with an evaluation every few steps)."""
        self._comm_at_start = self.state.comm_seconds
        self._started = time.perf_counter()

    def step_done(self) -> tuple[float, float]:
        """This step's own seconds and its communication's, counted into the run's."""
        seconds = time.perf_counter() - self._started
        self.step_seconds += seconds
        return seconds, self.state.comm_seconds - self._comm_at_start

    def since(self, started: float, boundary: bool = False) -> None:
        """Control work since ``started`` (``time.perf_counter()``); at a boundary or not."""
        seconds = time.perf_counter() - started
        self.control_seconds += seconds
        if boundary:
            self.boundary_seconds += seconds


@dataclass(frozen=True)
class RankParts:
    """The parts of one rank's loop that its checkpoint holds (``rank<r>.pt`` and, on rank
    0, the shared model, optimizer and scheduler) and that its totals count: the loop's own
    objects, which a restore changes in place."""

    rank: int
    world_size: int
    seed: int  #: the run's seed (a resize draws new ranks' state from it)
    strategy: GradientStrategy
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_scaler: torch.amp.GradScaler | None
    judge: StepJudge
    handoff: PlanHandoff
    progress: Progress
    outages: Outages
    lr_ramp: LrRamp
    preemption: PreemptionWatch


class InProgress:
    """An attribute of the loop that its :class:`Progress` keeps: read and written there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loop: Any, owner: type | None = None) -> Any:
        return self if loop is None else getattr(loop.progress, self.name)

    def __set__(self, loop: Any, value: Any) -> None:
        setattr(loop.progress, self.name, value)
