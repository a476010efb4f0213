"""What the local-step choice (:class:`~raycomp.controllers.policies.local.LocalChoice`) learns
over a run: the H in force and its damping, the step-backs, and what local steps measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from raycomp.plan import Plan

from .cost_model import CostState


@dataclass
class Sample:
    """One boundary under local steps: its steps, and their mean compute and wait (s)."""

    steps: int
    compute: float
    comm: float


@dataclass
class Measured:
    """A step under local steps at ``h``, measured over the latest boundaries (s)."""

    h: int
    compute: float
    wait: float


@dataclass
class LocalRecord:
    """One boundary's outcome: the H in force after it (0: per step), what it asked for (an
    H, or "step back" / "recover"), and why."""

    step: int
    h: int | None
    asked: int | str
    reason: str


@dataclass
class LocalState:
    ceiling: int  # the largest H allowed (halved by step-backs)
    cost: CostState = field(default_factory=CostState)  # per-step figures, not learnt under local steps
    chosen: int | None = None  # the H in force (0: per step), None before any choice
    wanted: int | None = None  # a different H asked for at the previous boundary
    strikes: int = 0  # boundaries in a row that asked for ``wanted``
    fallbacks_seen: int = 0
    calm: int = 0  # boundaries in a row without a step back since the largest H was lowered
    best_loss: float | None = None  # lowest smoothed loss since local steps began
    behind: int = 0  # boundaries in a row with the loss behind
    last: Plan | None = None  # the inner policy's latest per-step plan
    #: measured under local steps: an inner step's seconds, and a sync's seconds over what
    #: the byte model predicts for it (None until measured)
    inner_compute: float | None = None
    sync_scale: float | None = None
    samples: list[Sample] = field(default_factory=list)  # the boundaries under sampled_h
    sampled_h: int = 0  # the H the samples were taken under
    sampled_step: int = -1  # the latest boundary taken
    measured: Measured | None = None  # the latest H measured
    #: seconds a sync kept on the wire adds to the inner steps it overlaps, and the two H it
    #: was measured from (None until a pair has been)
    slowdown: float | None = None
    slowdown_from: list[int] = field(default_factory=list)
    probing: int = 0  # an H taken to be measured (a probe), held until it is
    history: list[LocalRecord] = field(default_factory=list)  # every boundary's outcome


__all__ = ["LocalRecord", "LocalState", "Measured", "Sample"]
