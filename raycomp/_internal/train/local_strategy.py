"""``compression.local.mode`` ``fixed`` or ``auto``: per-step compression or local steps, as
the plan in force says.

The model is in DDP with raycomp's comm hook, as for ``mode: off``. A plan without
:attr:`~raycomp.plan.Plan.local` runs per step through the hook. A plan with it switches DDP's
gradient synchronisation off (DDP then issues no collective at all: no bucket reduction,
no buffer broadcast) and hands the weights to :class:`raycomp._internal.local.LocalSteps`: every
``sync_every`` steps the pseudo-gradients travel compressed as the plan's layer specs say,
and the outer optimizer steps the synchronised weights.

The switch happens where the loop installs a plan, which is the same step on every rank.
Leaving local steps first syncs every fragment, so that the ranks hold the same weights
again before DDP resumes, and makes the inner optimizer's per-replica state equal
(:mod:`raycomp._internal.local.inner_state`: with different momenta the same mean gradient would
move the ranks apart again); entering them starts a fresh schedule from the current (equal)
weights. A run that ends in local steps syncs every fragment once more (:meth:`LocalStepsStrategy.merge`),
so that the model every rank holds at the end is the merged one, not its own replica.

With two levels (``compression.levels: auto`` on several nodes of several workers) a
replica is a whole node: during local steps DDP keeps reducing every inner step's gradients,
inside the node only (the hook's :attr:`~raycomp._internal.ddp.hook.CompressionState.inside_node`, dense
on the fast link), and each sync's pseudo-gradient crosses nodes in pieces, one per rank of
the node, compressed (:class:`~raycomp._internal.local.LocalSteps` with ``levels``). DDP's broadcast of
buffers stays off, as for flat local steps: buffers are averaged at syncs.

The guard cannot judge each inner step as it does per step (the gradients differ per rank
and nothing is exchanged); instead each rank skips its own non-finite inner steps, and the
loss every rank saw since the previous sync rides in the sync's collective, so the guard
judges every sync on the same numbers on every rank (:meth:`LocalStepsStrategy.after_optimizer_step`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from raycomp._internal.ddp.hook import CompressionState
from raycomp._internal.local import LocalSteps, equalize_inner_state, resolve_delay
from raycomp._internal.reduce.stats import LayerStats
from raycomp._internal.reduce.two_level import TwoLevelReducer
from raycomp._internal.train.ddp_strategy import compression_state, parameter_shapes, wrap_ddp
from raycomp._internal.train.gradient_strategy import GradientStrategy, StrategySetup
from raycomp._internal.wire.control_rows import SyncRow
from raycomp._internal.wire.ledger import WireLedger
from raycomp.config import LocalSection
from raycomp.plan import LocalMode, Plan

__all__ = ["LocalState", "LocalStepsStrategy", "local_hook_strategy", "local_strategy", "outer_sgd"]


def outer_sgd(params: Sequence[torch.Tensor], *, lr: float, momentum: float, nesterov: bool) -> torch.optim.Optimizer:
    """The outer optimizer of ``compression.local``: SGD over the synchronised weights."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)


class LocalState:
    """The :class:`~raycomp.train.gradient_strategy.GradientState` of a run that may take local
    steps: the hook's :class:`~raycomp._internal.ddp.hook.CompressionState` for per-step plans, a
    :class:`~raycomp._internal.local.LocalSteps` for local ones, one byte ledger for both."""

    def __init__(self, model: torch.nn.Module, hook: CompressionState, steps: LocalSteps,
                 options: LocalSection, optimizer: torch.optim.Optimizer | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.model, self.hook, self.steps, self.options = model, hook, steps, options
        #: the inner optimizer (and scaler) whose per-replica state is made equal on every
        #: rank when local steps end (:func:`raycomp._internal.local.equalize_inner_state`)
        self.optimizer, self.grad_scaler = optimizer, grad_scaler
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        steps.reducer.ledger = hook.reducer.ledger  # pseudo-gradient bytes count with the rest
        #: a replica is a node (two levels): inner steps stay data-parallel inside it
        self.node_replicas = isinstance(steps.reducer, TwoLevelReducer)
        if self.node_replicas:
            steps.reducer.intra_ledger = hook.reducer.intra_ledger  # type: ignore[attr-defined]
        self.mode: LocalMode | None = None  # the local steps in force, or None (per step)
        self.local_seconds = 0.0  # time spent in syncs of local steps

    # --- what the loop reads --------------------------------------------------------------
    ledger: WireLedger = property(lambda self: self.hook.ledger)  # type: ignore[assignment]
    stats: list[LayerStats] = property(lambda self: self.hook.stats)  # type: ignore[assignment]
    stats_step: int = property(lambda self: self.hook.stats_step)  # type: ignore[assignment]
    mean_samples = property(lambda self: self.hook.mean_samples)
    stats_plan = property(lambda self: self.hook.stats_plan)
    position = property(lambda self: self.hook.position)
    measures_mean_error = True
    step: int = property(lambda self: self.hook.step)  # type: ignore[assignment]
    plan: Plan = property(lambda self: self.hook.plan)  # type: ignore[assignment]
    intra_bytes: float = property(lambda self: self.hook.intra_bytes)  # type: ignore[assignment]

    @property
    def comm_seconds(self) -> float:
        return self.hook.comm_seconds + self.local_seconds

    @property
    def control_rows(self) -> torch.Tensor | None:
        return self.hook.control_rows

    @control_rows.setter
    def control_rows(self, rows: torch.Tensor | None) -> None:
        self.hook.control_rows = rows

    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        self.hook.stage_control(values, skippable)

    @property
    def control_skipped(self) -> bool:
        return self.hook.control_skipped

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        return self.hook.gradient_norm(parameters)

    def discard_step(self) -> None:
        self.hook.discard_step()

    # --- the mode ---------------------------------------------------------------------------
    def set_plan(self, plan: Plan) -> None:
        """Install ``plan`` from the next step on: per step through the hook, or local steps
        (entered, left or rescheduled here, at the same step on every rank)."""
        mode = plan.local_steps
        if mode != self.mode:
            if self.mode is not None:
                self.steps.merge_all()  # the ranks leave with the same weights
                if mode is None and self.optimizer is not None:  # and per step, the same inner state
                    equalize_inner_state(self.optimizer, self.grad_scaler, self.steps.group)
            if mode is not None:
                self._restart(mode)
            self._ddp_strategy(mode is None)
            self.mode = mode
        self.steps.set_plan(plan)
        self.hook.set_plan(plan)  # the agreement check compares this plan's digest

    def _restart(self, mode: LocalMode) -> None:
        """A fresh schedule for ``mode``, with the configured delay resolved for it."""
        self.steps.restart(mode.sync_every, mode.fragments,
                           resolve_delay(self.options.delay, mode.sync_every, mode.fragments))

    def _ddp_strategy(self, per_step: bool) -> None:
        if self.ddp:  # what DDP's no_sync() sets, kept: no reduction, no buffer broadcast
            self.model.require_backward_grad_sync = per_step or self.node_replicas
            self.model.require_forward_param_sync = per_step
            self.hook.inside_node = self.node_replicas and not per_step  # the node's own mean

    # --- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The hook's state and the local steps' (a sync on the wire is finished first)."""
        self.steps.quiesce()
        return {"hook": self.hook.state_dict(), "local": self.steps.state_dict(),
                "mode": None if self.mode is None else self.mode.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.hook.load_state_dict(state["hook"])
        mode = None if state["mode"] is None else LocalMode.from_dict(state["mode"])
        if mode is not None:  # the schedule the checkpoint was taken under, then its position
            self._restart(mode)
        self.steps.load_state_dict(state["local"])
        self._ddp_strategy(mode is None)
        self.mode = mode

    def close(self) -> None:
        self.steps.quiesce()
        self.hook.close()


class LocalStepsStrategy(GradientStrategy):
    """A :class:`~raycomp.train.gradient_strategy.GradientStrategy` that follows the plan's mode:
    per step (DDP and raycomp's hook) or local steps."""

    sharded = False

    def __init__(self, model: torch.nn.Module, state: LocalState) -> None:
        self.model, self.state = model, state
        self.bucket_cap_mb = model.bucket_bytes_cap / 2**20 if state.ddp else None
        self._losses: list[float] = []  # this rank's losses since the last sync (local steps)
        # syncs (finished, and of those skipped) whose rows the guard has been handed
        self._handed, self._skipped_handed = 0, 0

    @property
    def per_step(self) -> bool:
        """Whether this step's gradients are reduced (False while local steps run)."""
        return self.state.mode is None

    @property
    def per_node(self) -> int:
        """The ranks of a node in two levels (a replica of local steps is then a node), else 1."""
        return self.state.hook.per_node

    def time_node_link(self) -> float | None:
        """Seconds per byte inside a node, timed (two levels), else None. Collective."""
        return self.state.hook.time_node_link()

    def layers(self) -> dict[str, list[int]]:
        return parameter_shapes(self.model)

    def end_backward(self) -> None:
        if not self.state.ddp and self.per_step:  # one process: local compression + memory
            self.state.hook.allreduce_gradients()

    def agreement(self) -> tuple[float, ...]:
        """What every rank must hold equal at a boundary: the local steps' position."""
        steps = self.state.steps
        return (float(steps.inner_steps - steps.origin), float(steps.outer_steps), float(steps.skipped_outer))

    def after_optimizer_step(self, applied: bool, loss: float) -> list[list[float]] | None:
        """Per step: nothing. Local steps: count the inner step and, where a sync is due,
        run it with this rank's mean loss since the previous one riding inside; returns every
        rank's :class:`~raycomp._internal.wire.control_rows.SyncRow`, as floats, when a sync finished."""
        if self.per_step:
            self._handed_all()  # syncs that left local steps (merge_all) are not judged
            return None
        steps = self.state.steps
        if applied and math.isfinite(loss):
            self._losses.append(loss)
        if steps.starts_next():  # this rank's mean loss since the last sync rides with the next
            mean = math.fsum(self._losses) / len(self._losses) if self._losses else None
            steps.stage_control(SyncRow(mean_loss=mean).staged())
            self._losses = []
        started = time.perf_counter()
        steps.step()
        self.state.local_seconds += time.perf_counter() - started
        return self._finished_rows()

    def drain(self) -> list[list[float]] | None:
        """Finish a sync kept on the wire (``delay``) now, and hand over its rows."""
        if self.per_step:
            return None
        self.state.steps.quiesce()
        return self._finished_rows()

    def merge(self) -> int:
        """At the end of a run (after :meth:`drain`): sync every fragment, so that every rank
        holds the same weights; the outer steps applied (0 per step, or where no inner step
        ran since the ranks last held the same weights). The merge is not judged: nothing
        trains after it."""
        if self.per_step:
            return 0
        applied = self.state.steps.merge_all()
        self._handed_all()
        return applied

    def _finished_rows(self) -> list[list[float]] | None:
        """The rows of the sync that finished since the guard was last handed one (in a step,
        or early: :meth:`drain`, a checkpoint's quiesce), once; None if none did."""
        steps = self.state.steps
        if steps.last_rows is None:  # restored from a checkpoint: nothing finished since
            self._handed_all()
            return None
        if steps.outer_steps + steps.skipped_outer == self._handed:
            return None
        rows = steps.last_rows.tolist()
        if steps.skipped_outer > self._skipped_handed:  # NaN/Inf reached the mean: every rank saw it
            rows = [dataclasses.replace(SyncRow.from_row(row), nonfinite=True).to_row() for row in rows]
        self._handed_all()
        return rows

    def _handed_all(self) -> None:
        steps = self.state.steps
        self._handed, self._skipped_handed = steps.outer_steps + steps.skipped_outer, steps.skipped_outer


def local_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> LocalStepsStrategy:
    """raycomp's DDP path (buckets, the compressed hook) plus local steps over the same model."""
    from raycomp._internal.ddp.buckets import ddp_kwargs

    return local_hook_strategy(wrap_ddp(model, setup, ddp_kwargs(setup.options.compression, model)), optimizer, setup)


def local_hook_strategy(model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: StrategySetup) -> LocalStepsStrategy:
    """:func:`local_strategy` on a model already wrapped in DDP (a framework's), as
    :func:`raycomp._internal.train.ddp_strategy.ddp_hook_strategy` is for per-step compression."""
    from raycomp._internal.ddp.hook import compression_hook

    options = setup.options
    c, local = options.compression, options.compression.local
    hook = compression_state(model, setup)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.register_comm_hook(hook, compression_hook)
    outer = partial(outer_sgd, lr=local.outer_lr, momentum=local.outer_momentum, nesterov=local.nesterov)
    steps = LocalSteps(getattr(model, "module", model), sync_every=local.sync_every, outer_optimizer=outer,
                       memory="none" if c.memory == "none" else "residual", fragments=local.fragments,
                       delay=resolve_delay(local.delay, local.sync_every, local.fragments),
                       buffers=local.buffers, process_group=setup.control_group, seed=options.seed,
                       min_compress_numel=c.min_compress_numel,
                       levels=hook.levels)
    return LocalStepsStrategy(model, LocalState(model, hook, steps, local, optimizer, setup.grad_scaler))
