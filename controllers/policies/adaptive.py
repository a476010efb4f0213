"""The default policy: compress only as much as the measured link makes worth it.

At every control boundary it:

1. measures the link, the compute and each collective family's round overhead
   (:class:`~raycomp.controllers.policies.cost_model.CostModel`);
2. gives each compressible layer a ladder, heaviest compression first: lossy rungs
   (PowerSGD ranks for matrices, else Top-K ratios), near-lossless rungs (int4, int8, bf16,
   or any compressor that declares itself near-lossless), then dense
   (:class:`~raycomp.controllers.policies.ladders.Ladders`);
3. raises a layer's floor on its ladder while it is in a critical regime (Accordion: its
   gradient norm changes fast) and for good once its measured error exceeds ``max_error``;
4. prices the candidate plans (one shift on every ladder, the all-dense plan last), keeps
   a plan with a lossy layer only if it is ``lossy_margin`` faster than the best without,
   and takes the lightest plan within ``slack`` of the fastest;
5. keeps the plan in force while it stays within that band (hysteresis), switching after
   ``PATIENCE`` boundaries outside it.

Dense is a candidate, so "don't compress" is an outcome whenever compression saves less
than ``slack``; until a dense interval has timed the link the plan stays dense. During
``compression.warmup_steps`` (``warmup: near_lossless``, the default) the same steps choose
among the near-lossless rungs and dense only, so a slow link is not paid in full fp32 while
the lossy rungs and local steps wait for the warm-up's end. Options:
:class:`AdaptiveOptions`; the derivation and its measured grounds: ``docs/cost-model.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raycomp.config.policy_options import AdaptiveOptions

from ..state import RunState
from .adaptive_why import WarmupWhy
from .base import Policy
from .chooser import Chooser, ChooserState
from .cost_model import CostModel, CostState
from .decision import Decision


@dataclass
class AdaptiveState:
    cost: CostState  # the link, the compute and each family's round overhead, as measured
    choice: ChooserState  # regimes, floors and the plan in force
    warm: ChooserState | None = None  # the warm-up's own choice (None: a dense warm-up)


class AdaptivePolicy(Policy):
    name = "adaptive"
    options_model = AdaptiveOptions
    options: AdaptiveOptions

    def __init__(self, options: AdaptiveOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.cost = CostModel(options.round_seconds, options.bandwidth, options.sharded, options.decode_rate)
        self.choice = Chooser(options, self.cost, self.min_numel)
        # the warm-up's own choice: the same measurements, the near-lossless rungs and dense
        near = options.warmup == "near_lossless" and bool(options.near_lossless)
        self.warm = Chooser(options.model_copy(update={"lossy": "never"}), self.cost, self.min_numel) if near else None
        self.state: AdaptiveState = AdaptiveState(self.cost.state, self.choice.state,
                                                  None if self.warm is None else self.warm.state)

    def restored(self) -> None:
        self.cost.state, self.choice.state = self.state.cost, self.state.choice
        if self.warm is not None:
            if self.state.warm is None:
                self.state.warm = ChooserState()
            self.warm.state = self.state.warm

    def cost_models(self) -> list[CostModel]:
        return [self.cost]

    def decide(self, run: RunState) -> Decision:
        self.cost.measure(run)
        return self.choice.decide(run)

    def warmup(self, run: RunState) -> Decision | None:
        if self.warm is None:
            return super().warmup(run)
        self.cost.measure(run)
        decision = self.warm.decide(run)
        return Decision.of(decision.plan, WarmupWhy(decision.why))

    def details(self) -> dict[str, Any]:
        cost, choice = self.cost, self.choice.state
        return {
            "bandwidth_bytes_per_s": cost.bw, "bandwidth_assumed": cost.assumed_bw is not None,
            "round_overhead_s": dict(cost.overhead), "round_overhead_measured": bool(cost.overhead),
            "compute_s": cost.compute, "predicted_step_s": list(choice.predicted),
            "shift": choice.shift, "dense": choice.dense_chosen, "switches": choice.switches,
            "lossy": self.choice.lossy, "critical_layers": sorted(n for n, c in choice.critical.items() if c),
            "error_floor": dict(choice.error_floor), "last_detection_step": choice.last_detect,
            "history": [[r.step, r.choice, r.reason] for r in choice.history],
            "warmup_history": [] if self.warm is None else [[r.step, r.choice, r.reason]
                                                            for r in self.warm.state.history],
        }


__all__ = ["AdaptivePolicy"]
