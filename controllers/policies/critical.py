"""Light compression in critical regimes, heavy compression otherwise (Accordion).

Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
Identification", MLSys 2021 (Algorithm 1, per-layer variant)::

    every window_steps boundary steps, for each compressible layer l:
        cur_l  = mean gradient norm of l over the window that just ended
        prev_l = the same mean over the previous window
        if no prev_l (first window) or |prev_l - cur_l| / prev_l >= threshold:
            l is critical -> compressor `low`  (light compression)
        else:
            compressor `high` (heavy compression)
        prev_l <- cur_l

Training starts in a critical regime, so the first window compresses everything with
``low``. Between detections the policy repeats its last plan. Layers below
``min_compress_numel`` are not listed and stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raycomp.config.policy_options import CriticalOptions
from raycomp.plan import Plan

from ..state import RunState
from .base import Policy, compressible_layers, spec
from .decision import Decision

LOW, HIGH = "low", "high"


@dataclass(frozen=True)
class CriticalWhy:
    critical: int  # layers in a critical regime (light compression)
    layers: int
    rule: str = "critical.regimes"

    def text(self) -> str:
        return f"critical: {self.critical}/{self.layers} layers critical"


@dataclass
class CriticalState:
    last_step: int | None = None  # step of the latest detection
    prev_norms: dict[str, float] = field(default_factory=dict)  # layer -> mean norm of its last window
    regimes: dict[str, str] = field(default_factory=dict)  # layer -> LOW or HIGH
    detections: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # layer -> regime -> windows


class CriticalPolicy(Policy):
    name = "critical"
    options_model = CriticalOptions

    def __init__(self, options: CriticalOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.low, self.high = spec(options.low), spec(options.high)
        self.threshold = float(options.threshold)
        self.window = int(options.window_steps)
        self.state: CriticalState = CriticalState()

    def decide(self, run: RunState) -> Decision:
        if self.state.last_step is None or run.step - self.state.last_step >= self.window:
            self._detect(run)
        layers = compressible_layers(run, self.min_numel)
        chosen = {n: self.high if self.state.regimes.get(n, LOW) == HIGH else self.low for n in layers}
        critical = sum(1 for n in layers if self.state.regimes.get(n, LOW) == LOW)
        return Decision.of(Plan.per_layer(chosen), CriticalWhy(critical, len(layers)))

    def _detect(self, run: RunState) -> None:
        first = self.state.last_step is None
        start = run.step - self.window if first else self.state.last_step  # window = (start, step]
        for name in compressible_layers(run, self.min_numel):
            norms = [v for s, v in run.layers[name].grad_norm if start < s <= run.step]
            if not norms:
                continue  # no statistics in this window: keep the regime and the reference
            cur = sum(norms) / len(norms)
            prev = self.state.prev_norms.get(name)
            if prev is None:
                critical = True
            elif prev > 0:
                critical = abs(prev - cur) / prev >= self.threshold
            else:
                critical = cur > 0
            regime = LOW if critical else HIGH
            self.state.regimes[name] = regime
            counts = self.state.counts.setdefault(name, {LOW: 0, HIGH: 0})
            counts[regime] += 1
            self.state.prev_norms[name] = cur
        self.state.last_step = run.step
        self.state.detections += 1

    def details(self) -> dict[str, Any]:
        return {
            "detections": self.state.detections, "last_detection_step": self.state.last_step,
            "threshold": self.threshold, "window_steps": self.window,
            "low": str(self.low), "high": str(self.high),
            "regime_counts": self.state.counts, "last_regimes": dict(self.state.regimes),
        }



__all__ = ["CriticalPolicy", "CriticalWhy"]
