"""Compress just enough that communication hides behind computation.

A measurement-driven rule in the spirit of bandwidth-aware compression (e.g. Xu et al.,
"GRACE: A Compressed Communication Framework for Distributed Machine Learning",
ICDCS 2021; Agarwal et al., "On the Utility of Gradient Compression in Distributed
Training Systems", MLSys 2022: compression pays only where communication is exposed)::

    at every boundary step, from the last two Timing entries (running byte totals):
        steps = their step difference (interval_steps if not positive)
        wire  = delta wire_bytes  / (world_size * steps)    bytes per rank per step
        dense = delta dense_bytes / (world_size * steps)    dense-equivalent, ditto
        bw    = wire / comm_seconds;  t_c = compute_seconds
        for r in ratios, largest first:            (1.0 = dense all-reduce, `none`)
            t(r) = dense * f(r) / bw,  f(1) = 1,  f(r) = W * r for Top-K
            if t(r) <= target_overlap * t_c: choose r; stop
        otherwise choose the smallest ratio
        hysteresis: switch only when two consecutive choices differ from the current r

``f(r) = W r``: Top-K is all-gathered, ``(W - 1) * 8 r N`` bytes per rank, against
``2 (W - 1) / W * 4 N`` for the dense ring all-reduce (see ``raycomp._internal.transports``);
with two ranks this is ``2 r`` (values + indices). Layers below ``min_compress_numel``
are not listed and stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raycomp.config.policy_options import BandwidthOptions
from raycomp.plan import CompressorSpec, Plan

from ..state import RunState
from .base import Policy, compressible_layers
from .decision import Decision

HISTORY = 32
PATIENCE = 2  # consecutive differing choices before a switch


@dataclass
class Choice:
    """One boundary's choice: the ratio it asked for, and the ratio in force after it."""

    step: int
    asked: float
    current: float


@dataclass(frozen=True)
class BandwidthWhy:
    ratio: float  # the Top-K ratio in force (1.0: dense)
    rule: str = "bandwidth.ratio"

    def text(self) -> str:
        return f"bandwidth: ratio {self.ratio:g}"


@dataclass
class BandwidthState:
    current: float | None = None  # the Top-K ratio in force (1.0: dense)
    strikes: int = 0  # boundaries in a row that asked for another ratio
    switches: int = 0
    #: the latest estimate: bandwidth (bytes/s, None: unlimited), compute_seconds, dense_bytes_per_step
    estimate: dict[str, float | None] = field(default_factory=dict)
    history: list[Choice] = field(default_factory=list)  # the latest HISTORY boundaries


class BandwidthPolicy(Policy):
    name = "bandwidth"
    options_model = BandwidthOptions

    def __init__(self, options: BandwidthOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.ratios = sorted({float(r) for r in options.ratios}, reverse=True)
        self.target = float(options.target_overlap)
        self.state: BandwidthState = BandwidthState()

    def decide(self, run: RunState) -> Decision | None:
        s = self.state
        estimate = self._estimate(run)
        if estimate is not None:
            s.estimate = estimate
            choice = self._choose(run.world_size, **estimate)
            if s.current is None or choice == s.current:
                s.current, s.strikes = choice, 0
            else:
                s.strikes += 1
                if s.strikes >= PATIENCE:
                    s.current, s.strikes = choice, 0
                    s.switches += 1
            s.history = [*s.history, Choice(run.step, choice, s.current)][-HISTORY:]
        if s.current is None:
            return None  # nothing measured yet: keep the current plan
        if s.current >= 1.0:
            return Decision.of(Plan(), BandwidthWhy(s.current))
        topk = CompressorSpec.of("topk", ratio=s.current)
        return Decision.of(Plan.per_layer({n: topk for n in compressible_layers(run, self.min_numel)}),
                           BandwidthWhy(s.current))

    @staticmethod
    def _estimate(run: RunState) -> dict[str, Any] | None:
        if len(run.timings) < 2:
            return None
        t0, t1 = run.timings[-2], run.timings[-1]
        if t0.world_size != t1.world_size:
            return None  # an elastic resize between them: their totals do not subtract
        steps = t1.step - t0.step if t1.step > t0.step else run.interval_steps
        per = max(1, run.world_size) * max(1, steps)
        wire = (t1.wire_bytes - t0.wire_bytes) / per
        dense = (t1.dense_bytes - t0.dense_bytes) / per
        bandwidth: float | None = None  # None: unlimited
        if dense <= 0 or t1.comm_seconds <= 0:
            pass  # nothing to send, or sending took no time
        elif wire <= 0:
            return None  # dense traffic but no wire bytes counted: no estimate
        else:
            bandwidth = wire / t1.comm_seconds
        return {"bandwidth": bandwidth, "compute_seconds": max(0.0, t1.compute_seconds),
                "dense_bytes_per_step": max(0.0, dense)}

    def _choose(self, world_size: int, bandwidth: float | None, compute_seconds: float,
                dense_bytes_per_step: float) -> float:
        for r in self.ratios:
            factor = 1.0 if r >= 1.0 else max(2, world_size) * r
            seconds = 0.0 if bandwidth is None else dense_bytes_per_step * factor / bandwidth
            if seconds <= self.target * compute_seconds:
                return r
        return self.ratios[-1]

    def details(self) -> dict[str, Any]:
        s = self.state
        return {"ratio": s.current, "switches": s.switches, "target_overlap": self.target, **s.estimate,
                "history": [[c.step, c.asked, c.current] for c in s.history]}


__all__ = ["BandwidthPolicy", "BandwidthWhy"]
