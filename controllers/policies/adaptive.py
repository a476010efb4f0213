"""The default policy: compress only as much as the measured link makes worth it.

At every control boundary it:

1. measures the link, the compute and each collective family's round overhead
   (:class:`~controllers.policies.cost_model.CostModel`);
2. gives each compressible layer a ladder, heaviest compression first: lossy rungs
   (PowerSGD ranks for matrices, else Top-K ratios), near-lossless rungs (int4, int8, bf16,
   or any compressor that declares itself near-lossless), then dense
   (:class:`~controllers.policies.ladders.Ladders`);
3. raises a layer's floor on its ladder while it is in a critical regime (Accordion: its
   gradient norm changes fast) and for good once its measured error exceeds ``max_error``;
4. prices the candidate plans (one shift on every ladder, the all-dense plan last), keeps
   a plan with a lossy layer only if it is ``lossy_margin`` faster than the best without,
   and takes the lightest plan within ``slack`` of the fastest;
5. keeps the plan in force while it stays within that band (hysteresis), switching after
   ``PATIENCE`` boundaries outside it.

Dense is a candidate, so "don't compress" is an outcome whenever compression saves less
than ``slack``; until a dense interval has timed the link the plan stays dense. Options:
:class:`AdaptiveOptions`; the derivation and its measured grounds: ``docs/cost-model.md``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from controllers.policies.base import Policy, PolicyOptions
from controllers.policies.chooser import Chooser
from controllers.policies.cost_model import CostModel
from controllers.policies.ladders import check_near_lossless, heaviest_first, near_lossless_names
from controllers.state import RunState
from raycomp.plan import Plan

#: the families one figure of round overhead stood for in older snapshots
LEGACY_FAMILIES = ("powersgd", "topk", "quantized", "bf16", "fp16")


class AdaptiveOptions(PolicyOptions):
    """``compression.adaptive``: the default policy's options (each explained, with the
    measurements behind its default, in ``docs/cost-model.md``)."""

    not_shardable = None
    #: PowerSGD ranks for matrices, heaviest first (payload (rows + cols) x rank fp32)
    ranks: list[Annotated[int, Field(ge=1, le=1024)]] = [1, 2, 4, 8]
    #: Top-K densities for the compressible tensors PowerSGD cannot shrink, heaviest first
    topk_ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.01, 0.1]
    #: near-lossless rungs between the lossy ones and dense, sorted heaviest first by their
    #: declared bytes per element: any compressor whose ``Cost`` says near-lossless (int4,
    #: int8, bf16, fp16, or a user's registered one). ``[]``: lossy or dense
    near_lossless: list[str] = ["int4", "int8", "bf16"]
    #: whether the ladders offer the lossy rungs: "auto" lets ``raycomp.train.prepare_model``
    #: decide from the optimizer (yes for SGD and ASGD, no for Adam and the like); "always"
    #: and "never" force it ("never" needs a near-lossless rung)
    lossy: Literal["auto", "always", "never"] = "auto"
    #: the run reduce-scatters its gradients (FSDP; raycomp sets it): near-lossless rungs
    #: and dense only, bytes at (W-1)/W per element, no extra rounds
    sharded: bool = False
    #: Accordion's eta: a relative change of a layer's mean gradient norm between two
    #: windows at or above this is a critical regime
    threshold: Annotated[float, Field(gt=0)] = 0.5
    #: steps per regime window; also how often error is re-judged
    window_steps: Annotated[int, Field(ge=1)] = 50
    #: how many rungs lighter a critical layer on a lossy rung goes (not past the first
    #: near-lossless rung); 0 turns regime detection off
    critical_boost: Annotated[int, Field(ge=0, le=16)] = 2
    #: a layer whose measured relative compression error over a window exceeds this leaves
    #: the lossy rungs for the rest of the run (on a near-lossless rung: one rung lighter)
    max_error: Annotated[float, Field(gt=0, le=1)] = 0.9
    #: a plan with a lossy layer is taken only if predicted at least this fraction faster
    #: than the fastest plan without one
    lossy_margin: Annotated[float, Field(ge=0, lt=1)] = 0.3
    #: take the lightest plan within this fraction of the fastest; also the hysteresis band
    slack: Annotated[float, Field(ge=0, le=10)] = 0.1
    #: seconds an extra collective round costs until the run has measured it, per family
    round_seconds: Annotated[float, Field(ge=0, le=10)] = 0.001
    #: link bandwidth in bytes per second per rank to plan for instead of measuring it
    bandwidth: Annotated[float, Field(gt=0)] | None = None

    @field_validator("ranks", "topk_ratios")
    @classmethod
    def _ladder(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("at least one value is required")
        return sorted(set(values))  # heaviest first

    @field_validator("near_lossless")
    @classmethod
    def _near_lossless(cls, values: list[str]) -> list[str]:
        return heaviest_first([check_near_lossless(v) for v in values])

    @model_validator(mode="after")
    def _some_rung(self) -> AdaptiveOptions:
        for flag, on in (("sharded: true", self.sharded), ("lossy: never", self.lossy == "never")):
            if on and not self.near_lossless:
                raise ValueError(f"{flag} needs at least one near_lossless rung ({', '.join(near_lossless_names())})")
        return self

    def check_sharded(self, key: str) -> None:
        if not self.near_lossless:
            raise ValueError(f"{key}.near_lossless: empty, but with scaling.strategy=fsdp the adaptive policy "
                             f"chooses among them only; allowed: {', '.join(near_lossless_names())}")


class AdaptivePolicy(Policy):
    name = "adaptive"
    options_model = AdaptiveOptions
    options: AdaptiveOptions

    def __init__(self, options: AdaptiveOptions, min_compress_numel: int = 1024) -> None:
        super().__init__(options, min_compress_numel)
        self.cost = CostModel(options.round_seconds, options.bandwidth, options.sharded)
        self.choice = Chooser(options, self.cost, self.min_numel)

    def decide(self, run: RunState) -> Plan | None:
        self.cost.measure(run)
        return self.choice.decide(run)

    def details(self) -> dict[str, Any]:
        cost, choice = self.cost, self.choice
        return {
            "bandwidth_bytes_per_s": cost.bw, "bandwidth_assumed": cost.assumed_bw is not None,
            "round_overhead_s": dict(cost.overhead), "round_overhead_measured": bool(cost.overhead),
            "compute_s": cost.compute, "predicted_step_s": list(choice.predicted),
            "shift": choice.shift, "dense": choice.dense_chosen, "switches": choice.switches,
            "lossy": choice.lossy, "critical_layers": sorted(n for n, c in choice.critical.items() if c),
            "error_floor": dict(choice.error_floor), "last_detection_step": choice.last_detect,
            "history": list(choice.history),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.cost.state_dict(), **self.choice.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return  # nothing saved yet: start fresh
        self.cost.load_state_dict(state, LEGACY_FAMILIES)
        self.choice.load_state_dict(state, LEGACY_FAMILIES)


__all__ = ["AdaptiveOptions", "AdaptivePolicy"]
