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

from typing import Any

from controllers.policies.base import Policy, compressible_layers, spec
from controllers.state import RunState
from raycomp.config.policy_options import CriticalOptions
from raycomp.plan import Plan

LOW, HIGH = "low", "high"


class CriticalPolicy(Policy):
    name = "critical"
    options_model = CriticalOptions

    def __init__(self, options: CriticalOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.low, self.high = spec(options.low), spec(options.high)
        self.threshold = float(options.threshold)
        self.window = int(options.window_steps)
        self.last_step: int | None = None  # step of the latest detection
        self.prev_norms: dict[str, float] = {}
        self.regimes: dict[str, str] = {}
        self.detections = 0
        self.counts: dict[str, dict[str, int]] = {}

    def decide(self, run: RunState) -> Plan:
        if self.last_step is None or run.step - self.last_step >= self.window:
            self._detect(run)
        layers = compressible_layers(run, self.min_numel)
        chosen = {n: self.high if self.regimes.get(n, LOW) == HIGH else self.low for n in layers}
        critical = sum(1 for n in layers if self.regimes.get(n, LOW) == LOW)
        return Plan.per_layer(chosen, reason=f"critical: {critical}/{len(layers)} layers critical")

    def _detect(self, run: RunState) -> None:
        first = self.last_step is None
        start = run.step - self.window if first else self.last_step  # window = (start, step]
        for name in compressible_layers(run, self.min_numel):
            norms = [v for s, v in run.layers[name].grad_norm if start < s <= run.step]
            if not norms:
                continue  # no statistics in this window: keep the regime and the reference
            cur = sum(norms) / len(norms)
            prev = self.prev_norms.get(name)
            if prev is None:
                critical = True
            elif prev > 0:
                critical = abs(prev - cur) / prev >= self.threshold
            else:
                critical = cur > 0
            regime = LOW if critical else HIGH
            self.regimes[name] = regime
            counts = self.counts.setdefault(name, {LOW: 0, HIGH: 0})
            counts[regime] += 1
            self.prev_norms[name] = cur
        self.last_step = run.step
        self.detections += 1

    def details(self) -> dict[str, Any]:
        return {
            "detections": self.detections, "last_detection_step": self.last_step,
            "threshold": self.threshold, "window_steps": self.window,
            "low": str(self.low), "high": str(self.high),
            "regime_counts": self.counts, "last_regimes": dict(self.regimes),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "prev_norms": dict(self.prev_norms),
                "regimes": dict(self.regimes), "detections": self.detections,
                "counts": {k: dict(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return  # nothing saved yet: start fresh
        self.last_step = state["last_step"]
        self.prev_norms = {k: float(v) for k, v in state["prev_norms"].items()}
        self.regimes = dict(state["regimes"])
        self.detections = int(state["detections"])
        self.counts = {k: {LOW: int(v[LOW]), HIGH: int(v[HIGH])} for k, v in state["counts"].items()}


__all__ = ["CriticalPolicy"]
