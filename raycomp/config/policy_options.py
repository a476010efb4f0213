"""The built-in policies' options: ``compression.<policy>`` in a job config.

Each model is a :class:`PolicyOptions` (strict, frozen, one-line errors naming the key)
and belongs to the policy of the same name in ``raycomp.controllers.policies``, which decides from
it; the options live here, with the rest of the job config, so that validating a config
needs nothing of the controller. :data:`POLICY_OPTIONS` lists them by policy name.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from raycomp.compressors.near_lossless import (
    check_near_lossless,
    heaviest_first,
    near_lossless_names,
)
from raycomp.config.base import CompressorConfig, Strict, compressor


class PolicyOptions(Strict):
    """The options of a policy, ``compression.<policy>`` in a job config: strict (unknown
    keys refused), frozen, one-line errors naming the key.

    A sharded run (FSDP) reduce-scatters its gradients, and only some compressors can carry
    a reduce-scatter row (``raycomp.compressors.fits_a_shard``): a policy that may run there
    sets :attr:`not_shardable` to None and checks its options in :meth:`check_sharded`.
    """

    #: why the policy cannot steer a sharded run (the end of a one-line error), or None
    not_shardable: ClassVar[str | None] = "may choose compressors that cannot compress a reduce-scatter shard"

    def check_sharded(self, key: str) -> None:
        """ValueError (one line, naming the option under ``key``, e.g. ``compression.static``)
        unless every compressor these options may choose fits a reduce-scatter row."""

    @staticmethod
    def check_fits_a_shard(key: str, chosen: CompressorConfig) -> None:
        """ValueError naming ``key`` unless ``chosen`` can compress a reduce-scatter row."""
        from raycomp.compressors import fits_a_shard, shardable

        if not fits_a_shard(chosen.name):
            raise ValueError(f"{key}: {chosen.name!r} cannot compress a reduce-scatter shard; "
                             f"allowed with scaling.strategy=fsdp: {', '.join(shardable())}")


class StaticOptions(PolicyOptions):
    """``compression.static``: the one compressor."""

    config_key = "compression.static"

    not_shardable = None
    #: the compressor of every compressible layer at every step after the warm-up, by
    #: registry name with its parameters
    compressor: CompressorConfig = compressor("topk", ratio=0.01)

    def check_sharded(self, key: str) -> None:
        self.check_fits_a_shard(f"{key}.compressor", self.compressor)


class ScheduleStage(Strict):
    """One stage of ``compression.schedule``: a compressor from a step on."""

    #: the first step of the stage
    start_step: Annotated[int, Field(ge=0)]
    #: the stage's compressor, by registry name with its parameters
    compressor: CompressorConfig


class ScheduleOptions(PolicyOptions):
    """``compression.schedule``: stages by step, e.g. DGC's exponential density warm-up."""

    config_key = "compression.schedule"

    not_shardable = None
    #: the stages, ``start_step`` strictly increasing: each stage's compressor runs from its
    #: ``start_step`` until the next stage's
    stages: list[ScheduleStage] = [
        ScheduleStage(start_step=0, compressor=compressor("topk", ratio=0.25)),
        ScheduleStage(start_step=50, compressor=compressor("topk", ratio=0.06)),
        ScheduleStage(start_step=100, compressor=compressor("topk", ratio=0.015)),
        ScheduleStage(start_step=150, compressor=compressor("topk", ratio=0.004)),
    ]

    @field_validator("stages")
    @classmethod
    def _increasing(cls, stages: list[ScheduleStage]) -> list[ScheduleStage]:
        if not stages:
            raise ValueError("at least one stage is required")
        starts = [s.start_step for s in stages]
        if starts != sorted(set(starts)):
            raise ValueError(f"start_step values must strictly increase, got {starts}")
        return stages

    def check_sharded(self, key: str) -> None:
        for i, stage in enumerate(self.stages):
            self.check_fits_a_shard(f"{key}.stages[{i}].compressor", stage.compressor)


class CriticalOptions(PolicyOptions):
    """``compression.critical``: Accordion's two compressors and its regime detection."""

    config_key = "compression.critical"

    not_shardable = "chooses Top-K, which cannot compress a reduce-scatter shard"
    #: the light compressor, for layers in a critical regime
    low: CompressorConfig = compressor("topk", ratio=0.1)
    #: the heavy compressor, for the other layers
    high: CompressorConfig = compressor("topk", ratio=0.01)
    #: a relative change of a layer's mean gradient norm between two windows at or above
    #: this is a critical regime (Accordion's eta)
    threshold: Annotated[float, Field(gt=0)] = 0.5
    #: steps per detection window
    window_steps: Annotated[int, Field(ge=1)] = 50


def distinct_ratios(ratios: list[float], descending: bool = False) -> list[float]:
    """The ratios once each, sorted; ValueError if there are none."""
    if not ratios:
        raise ValueError("at least one ratio is required")
    return sorted(set(ratios), reverse=descending)


class ErrorBudgetOptions(PolicyOptions):
    """``compression.error_budget``: L-GreCo's candidate Top-K ratios and its budget."""

    config_key = "compression.error_budget"

    not_shardable = "chooses Top-K, which cannot compress a reduce-scatter shard"
    #: the Top-K densities a layer may get
    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.001, 0.003, 0.01, 0.03, 0.1]
    #: the error budget is the total error all layers would have at this one density
    reference_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01
    #: the budget is (1 + slack) x the reference error
    slack: Annotated[float, Field(ge=0, le=10)] = 0.0
    #: steps between two assignments of densities to layers
    every_steps: Annotated[int, Field(ge=1)] = 50

    _ratios = field_validator("ratios")(lambda cls, r: distinct_ratios(r))


class BandwidthOptions(PolicyOptions):
    """``compression.bandwidth``: Top-K ratios, and how much communication to hide."""

    config_key = "compression.bandwidth"

    not_shardable = "chooses Top-K, which cannot compress a reduce-scatter shard"
    #: the Top-K densities to choose among (1.0: dense)
    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001]
    #: the largest density whose predicted communication time is at most this x the
    #: compute time is chosen (else the smallest)
    target_overlap: Annotated[float, Field(gt=0, le=10)] = 1.0

    _ratios = field_validator("ratios")(lambda cls, r: distinct_ratios(r, descending=True))


class AdaptiveOptions(PolicyOptions):
    """``compression.adaptive``: the default policy's options (each explained, with the
    measurements behind its default, in ``docs/cost-model.md``)."""

    config_key = "compression.adaptive"

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
    #: what the policy sends during ``compression.warmup_steps``. "near_lossless": once a
    #: dense interval has timed the link, the plan of the near-lossless rungs and dense
    #: (chosen as with ``lossy: never``) where it saves time; the lossy rungs and local steps
    #: wait for the warm-up's end. A warm-up protects the fast-changing first steps from
    #: compression error and from ranks drifting apart (PowerSGD's and DGC's warm-ups,
    #: post-local SGD's dense start); int4/int8/bf16 with error feedback keep the loss
    #: from the first step, so dense fp32 there only costs time, which on a slow link is
    #: most of a dense step. "dense": every warm-up step dense
    warmup: Literal["near_lossless", "dense"] = "near_lossless"
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
    #: link bandwidth in bytes per second per rank to price plans with instead of measuring it
    bandwidth: Annotated[float, Field(gt=0)] | None = None
    #: bytes of all-gathered payload one rank decodes per second, to price an all-gather's
    #: decode of W payloads on its own (null: part of the measured round overhead)
    decode_rate: Annotated[float, Field(gt=0)] | None = None

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


#: each built-in policy's options model, by the policy's name (the order of
#: ``raycomp.controllers.policies.REGISTRY``, which checks that its policies use these)
POLICY_OPTIONS: dict[str, type[PolicyOptions]] = {
    "static": StaticOptions,
    "schedule": ScheduleOptions,
    "critical": CriticalOptions,
    "error_budget": ErrorBudgetOptions,
    "bandwidth": BandwidthOptions,
    "adaptive": AdaptiveOptions,
}

__all__ = ["POLICY_OPTIONS", "AdaptiveOptions", "BandwidthOptions", "CriticalOptions", "ErrorBudgetOptions",
           "PolicyOptions", "ScheduleOptions", "ScheduleStage", "StaticOptions", "distinct_ratios"]
