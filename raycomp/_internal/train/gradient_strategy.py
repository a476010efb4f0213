"""How a worker's gradients travel: the one extension point of :class:`~raycomp.train.TrainLoop`.

The loop never looks at how the gradients are reduced. It asks a factory
(:data:`GradientStrategyFactory`) for a :class:`GradientStrategy` once, at
:func:`raycomp.train.prepare_model`, and from then on only uses the protocol: the model to
train, the state that carries the plan and the guard's control rows, one call after each
backward and one after each optimizer step. raycomp's own factory is
:func:`raycomp._internal.train.default_strategy.raycomp_strategy`. Another factory
(``prepare_model(..., gradient_strategy=...)``) can put something else in its place, e.g.
torch's own DDP hooks for a side-by-side benchmark, as long as it keeps the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from raycomp._internal.reduce.stats import LayerStats
from raycomp._internal.train.options import TrainOptions
from raycomp._internal.wire.ledger import WireLedger
from raycomp.plan import Plan

__all__ = ["GradientState", "GradientStrategy", "GradientStrategyFactory", "StrategySetup"]


class GradientState(Protocol):
    """What the loop, its guard and its reporter read and steer on a rank: the plan, the
    byte ledger, the statistics and the guard's control rows. Kept by
    :class:`raycomp._internal.ddp.hook.CompressionState` (DDP) and :class:`raycomp._internal.fsdp.state.ShardedState`
    (FSDP2)."""

    ledger: WireLedger
    intra_bytes: float  # bytes sent inside the node so far (two levels; 0 when flat)
    stats: list[LayerStats]
    stats_step: int  # the step the statistics were measured at
    step: int  # steps reduced so far
    comm_seconds: float  # time spent communicating, whole run
    control_rows: torch.Tensor | None  # every rank's control row of this step, or None
    control_skipped: bool  # this step left skippable control values out (no rows after it)
    #: True: the state keeps, on statistics steps, ``mean_samples`` (layer -> this rank's
    #: sample of its input and of the applied mean), ``stats_plan`` (the plan of that step)
    #: and ``position`` (its place in the reduction), and the guard judges the applied
    #: mean's error at agreements (:mod:`raycomp._internal.reduce.mean_error`). False: each rank's own error
    #: rides in the step's control rows instead
    measures_mean_error: bool

    @property
    def plan(self) -> Plan: ...

    def set_plan(self, plan: Plan) -> None:
        """Install ``plan`` from the next step on (the same step on every rank)."""

    def stage_control(self, values: Sequence[float], skippable: bool = False) -> None:
        """Carry these floats of this rank to every rank with the next step's reduction;
        ``skippable``: unless that step would need a collective of their own for them
        (then :attr:`control_skipped` is True after it)."""

    def gradient_norm(self, parameters: Sequence[torch.Tensor]) -> float:
        """The norm of the reduced gradient the guard watches (the same on every rank)."""

    def discard_step(self) -> None:
        """The step was skipped: forget what it folded into error feedback."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Release threads and buffers."""


class GradientStrategy(Protocol):
    """One rank's gradient communication, as the loop uses it.

    The last four members (:attr:`per_node`, :meth:`time_node_link`, :meth:`drain`,
    :meth:`merge`) matter to some strategies only; a class that subclasses this protocol
    inherits their defaults (flat, nothing on the wire between steps, the ranks' weights
    equal after every step) and overrides what applies to it. A class that does not
    subclass it defines every member.
    """

    #: the model to train: wrapped (DDP), sharded (FSDP2) or as it was
    model: torch.nn.Module
    state: GradientState
    #: the parameters are sharded: every rank saves its own shards in a checkpoint
    sharded: bool
    #: DDP's bucket cap in MB, for the run's totals (None without DDP buckets)
    bucket_cap_mb: float | None

    def layers(self) -> dict[str, list[int]]:
        """What a plan names, each with its shape (the controller sizes compressors from it)."""

    @property
    def per_step(self) -> bool:
        """Whether this step's gradients are reduced across ranks (False while local steps
        run: the replicas then differ, and the guard judges syncs instead of steps)."""

    def end_backward(self) -> None:
        """After ``loss.backward()``: finish this step's reduction (a no-op where backward did)."""

    def after_optimizer_step(self, applied: bool, loss: float) -> list[list[float]] | None:
        """After the optimizer step (``applied``) or its skip, with this rank's ``loss``:
        local steps merge the ranks' weights here and return every rank's control row
        ``[non-finite, mean loss, has loss]`` of a sync that finished (else None); a
        per-step sync has nothing to do."""

    def agreement(self) -> tuple[float, ...]:
        """Numbers every rank must hold equal at a control boundary, beside the plan and the
        guard (local steps: the schedule's position); () if none."""

    # --- with defaults, for a subclass: what only some strategies need ---------------------
    @property
    def per_node(self) -> int:
        """The ranks of a node where compressed steps, or local steps' replicas, work in two
        levels: the controller prices plans and counts replicas by it. 1: flat."""
        return 1

    def time_node_link(self) -> float | None:
        """Seconds per byte of an all-reduce inside the node, timed by every rank at once
        before the run registers (a collective; the controller prices the node's own hops by
        it), where :attr:`per_node` is above 1. None: not timed."""
        return None

    def drain(self) -> list[list[float]] | None:
        """Before a checkpoint and at the end: finish communication still on the wire past a
        step (local steps' ``delay``) and return the rows of a sync that finished since the
        last :meth:`after_optimizer_step`, as that returns them; None: none finished
        (nothing stays on the wire between steps)."""
        return None

    def merge(self) -> int:
        """At the end of a run, after :meth:`drain`: make the ranks' weights equal where they
        may differ between steps (local steps) and return the outer steps that took; 0:
        they are equal after every step."""
        return 0


@dataclass(frozen=True)
class StrategySetup:
    """What a factory builds a :class:`GradientStrategy` from, besides the model and optimizer.

    Args:
        options: the run's options, resolved (:func:`raycomp.train.options.resolve_options`).
        device: this worker's device (``ray.train.torch.get_device()``).
        control_group: a gloo group for the small CPU exchanges (None: the default group,
            when that is gloo already).
        grad_scaler: the run's enabled ``torch.amp.GradScaler``, or None.
    """

    options: TrainOptions
    device: torch.device
    control_group: Any = None
    grad_scaler: torch.amp.GradScaler | None = None


#: ``factory(model, optimizer, setup) -> GradientStrategy``
GradientStrategyFactory = Callable[[torch.nn.Module, torch.optim.Optimizer, StrategySetup], GradientStrategy]
