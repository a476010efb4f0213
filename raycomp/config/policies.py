"""The options of each built-in policy (``compression.<policy>``), typed and documented."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from raycomp.config.base import CompressorConfig, _Strict, compressor


def _distinct_ratios(ratios: list[float], descending: bool = False) -> list[float]:
    if not ratios:
        raise ValueError("at least one ratio is required")
    return sorted(set(ratios), reverse=descending)


class StaticPolicy(_Strict):
    compressor: CompressorConfig = compressor("topk", ratio=0.01)


class ScheduleStage(_Strict):
    start_step: Annotated[int, Field(ge=0)]
    compressor: CompressorConfig


class SchedulePolicy(_Strict):
    """Piecewise plan by step, e.g. DGC's exponential density warm-up."""

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


class CriticalPolicy(_Strict):
    """Accordion: layers whose gradient norm changes fast are in a critical regime."""

    low: CompressorConfig = compressor("topk", ratio=0.1)  # light compression (critical)
    high: CompressorConfig = compressor("topk", ratio=0.01)  # heavy compression
    threshold: Annotated[float, Field(gt=0)] = 0.5  # relative norm change
    window_steps: Annotated[int, Field(ge=1)] = 50  # detection interval


class ErrorBudgetPolicy(_Strict):
    """L-GreCo: per-layer Top-K ratios minimising bytes under a total error budget."""

    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.001, 0.003, 0.01, 0.03, 0.1]
    reference_ratio: Annotated[float, Field(gt=0, le=1)] = 0.01  # budget = its total error
    slack: Annotated[float, Field(ge=0, le=10)] = 0.0
    every_steps: Annotated[int, Field(ge=1)] = 50

    _ratios = field_validator("ratios")(lambda cls, r: _distinct_ratios(r))


class BandwidthPolicy(_Strict):
    """Compress just enough that communication hides behind computation."""

    ratios: list[Annotated[float, Field(gt=0, le=1)]] = [1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001]
    target_overlap: Annotated[float, Field(gt=0, le=10)] = 1.0  # comm time / compute time

    _ratios = field_validator("ratios")(lambda cls, r: _distinct_ratios(r, descending=True))


class AdaptivePolicy(_Strict):
    """The default: measure the link, model each candidate plan's step time, pick the
    lightest compression that is (nearly) the fastest, and lighter still for layers in a
    critical regime (Accordion) or whose measured error is too high. "Dense" is one of the
    candidates: on a fast link it usually wins (Agarwal et al., MLSys'22: compression paid
    off in only 6 of 200+ data-center setups). Decision rule: ``controllers/policies/adaptive.py``.
    """

    #: PowerSGD ranks for matrices, heaviest first (Vogels et al., NeurIPS'19: rank 1-4
    #: matches dense accuracy on ResNet/LSTM with error feedback). Payload per layer is
    #: (rows + cols) x rank fp32, all-reduced. Drop 1 if your model trains worse at rank 1;
    #: add 16 or 32 for very wide layers.
    ranks: list[Annotated[int, Field(ge=1, le=1024)]] = [1, 2, 4, 8]
    #: Top-K densities for compressible tensors PowerSGD cannot take (1-D, or shapes whose
    #: factors are not smaller), heaviest first. Top-K is all-gathered: its bytes grow with
    #: the number of ranks, which the cost model accounts for.
    topk_ratios: list[Annotated[float, Field(gt=0, le=1)]] = [0.01, 0.1]
    #: Near-lossless rungs between the lossy ones and dense, heaviest first: int4 (8x fewer
    #: bytes) and int8 (4x), min-max per 2,048 elements in one batch of the scalable
    #: transport (all-to-all + all-gather; at 2 ranks one all-gather), and bf16 (2x, one
    #: more all-reduce). With error feedback they keep dense's per-step progress (relative
    #: error on the KJV transformer: 0.17-0.23 for int4, ~0.01 for int8), so a critical
    #: layer, a layer whose lossy error stays above ``max_error``, and a run whose optimizer
    #: rules the lossy rungs out (see ``lossy``) land here instead of on dense; a link too
    #: fast for the lossy rungs but too slow for dense gets them too. Measured at 100 Mbit/s,
    #: static int4 reached dense's target at the same steps as int8 on the KJV transformer
    #: (94.4 s against 119.6 s) and on 2 seeds of 3 of the Fashion-MNIST CNN, one evaluation
    #: later on the third (58.5 s against 74.1 s; docs/benchmarks/e2e-gpt-100mbit-int4.md,
    #: e2e-cnn-100mbit-int4.md). ``[]``: lossy or dense.
    near_lossless: list[Literal["int4", "int8", "bf16", "fp16"]] = ["int4", "int8", "bf16"]
    #: Whether the ladders offer the lossy rungs (PowerSGD, Top-K). "auto":
    #: ``raycomp.train.prepare_model`` decides from the optimizer: yes for SGD (with or
    #: without momentum, Nesterov, weight decay) and ASGD, whose update is linear in the
    #: gradient, so error feedback only delays what a lossy rung holds back; no for every
    #: other optimizer (Adam, AdamW, Adagrad, RMSprop, Lion, ...), whose update is not: Tang
    #: et al., "1-bit Adam", ICML 2021, found error-compensated compression does not work with
    #: Adam's variance term. Measured here: on the KJV transformer (AdamW) every plan that
    #: held PowerSGD or Top-K for long lost validation loss, while the Fashion-MNIST CNN (SGD)
    #: reached its target fastest on torch's PowerSGD. "always" / "never" force it ("never"
    #: needs a near-lossless rung; "auto" with ``near_lossless: []`` keeps the lossy rungs).
    #: A run registered without ``prepare_model`` (the hook alone) reads "auto" as "always".
    lossy: Literal["auto", "always", "never"] = "auto"
    #: The run reduce-scatters its gradients (FSDP; raycomp sets it for ``strategy="fsdp"``):
    #: the ladders hold only the near-lossless rungs and dense (what a reduce-scatter row can
    #: carry; PowerSGD and Top-K cannot), bytes are priced at (W-1)/W per element instead of
    #: an all-reduce's 2(W-1)/W, and no choice adds a round (every unit sends one all-to-all,
    #: dense included). Needs ``near_lossless``.
    sharded: bool = False
    #: Accordion's eta: relative change of a layer's mean gradient norm between two windows
    #: at or above this is a critical regime (Agarwal et al., MLSys'21 use 0.5). Lower it to
    #: protect more layers (less compression), raise it to compress through more change.
    threshold: Annotated[float, Field(gt=0)] = 0.5
    #: Steps per regime window (Accordion detects every few epochs; here, in steps). Use
    #: about an epoch or 5-10 control intervals; it is also how often error is re-judged.
    window_steps: Annotated[int, Field(ge=1)] = 50
    #: How many rungs lighter a critical layer on a lossy rung goes (rank 1 -> rank 4 with
    #: the default ranks, Accordion's heavy/light PowerSGD pair), but not past the first
    #: near-lossless rung (int4); a layer on a near-lossless rung stays there. On the
    #: Fashion-MNIST CNN (SGD) torch's PowerSGD rank 4 from step 20 reached the target at
    #: the same steps as int4 on 2 seeds of 3, at half int4's step. A run without lossy rungs
    #: (AdamW, see ``lossy``) has its critical layers on int4: on the KJV transformer
    #: PowerSGD rank 8 through the critical start cost validation loss the run never made
    #: up, while int4, int8 and bf16 matched dense. Floors stop at the last near-lossless
    #: rung: dense is the all-dense candidate and the guard's fallback, never a floor. Raise
    #: it (e.g. 4 with the default ranks and rungs) to put critical layers on int4 anyway.
    #: 0 turns regime detection off.
    critical_boost: Annotated[int, Field(ge=0, le=16)] = 2
    #: A layer whose measured relative compression error ||c - sent|| / ||c|| over a window
    #: (its samples since its compressor family arrived: a PowerSGD rank change does not
    #: restart the count) exceeds this leaves the lossy rungs for the rest of the run: it moves
    #: to the first near-lossless rung (one rung lighter if it is already there or there is
    #: none; never back: no flapping). With error feedback PowerSGD runs at 0.7-0.93 on the
    #: digits MLP and still matches dense accuracy; on the KJV transformer its error climbs
    #: from 0.7-0.9 to 0.94-0.98 within 100 steps and it falls behind dense per step from
    #: there; on a character LSTM trained with SGD (``jobs/configs/lstm_kjv.yaml``) it climbs
    #: to 0.98-0.99. Left on PowerSGD for as long as its loss still fell, that LSTM ended 5.6%
    #: above dense's validation loss (medians of 3 seeds), against 0.9% with this rule; on the
    #: Fashion-MNIST CNN (0.89-0.96) the same leniency cost nothing. Climbing PowerSGD ranks
    #: (up to 32) instead of leaving for int4 ended that LSTM 1.8% above dense, and
    #: ``max_error: 0.95`` 3.2% (1.721 against 1.668; 0.97 with the climb: 5.3%). Above 0.9
    #: less than a fifth (1 - 0.9^2) of the gradient's energy is sent per step. Lower it (e.g.
    #: 0.8) for models sensitive to compression, raise it to keep PowerSGD longer.
    max_error: Annotated[float, Field(gt=0, le=1)] = 0.9
    #: A plan that puts any layer on a lossy rung (PowerSGD, Top-K) is taken only if it is
    #: predicted at least this fraction faster than the fastest plan without one
    #: (near-lossless rungs or dense). A lossy rung can cost accuracy that int4 does not,
    #: so it has to buy a large speed-up. Measured at 100 Mbit/s, 3 seeds:
    #:
    #: - on the character LSTM (``jobs/configs/lstm_kjv.yaml``) PowerSGD is predicted 23-36%
    #:   faster than int4 depending on the hour (75 against 98 ms in the first run), at the
    #:   edge of this margin. It missed the loss target at every rank and seed, while int4
    #:   reached it at dense's steps. With this margin adaptive ended 0.5-0.9% above dense's
    #:   final loss in one hour and 1.4-1.8% in another, against 1.5-1.8% without it
    #:   (``docs/benchmarks/e2e-lstm-100mbit.md``, ``e2e-lstm-100mbit-lossy-margin.md``,
    #:   ``e2e-lstm-100mbit-lossy-margin-rerun.md``);
    #: - on the Fashion-MNIST CNN PowerSGD is predicted 36-45% faster than int4, and its
    #:   plans did not change.
    #:
    #: A lossy family is still tried once on the assumed round overhead (``round_seconds``),
    #: which can clear the margin: the LSTM ran PowerSGD for 20 of its first 50 steps on
    #: every seed. Lower it to take PowerSGD for smaller savings on a model it suits; 0
    #: compares lossy plans with the others on time alone.
    lossy_margin: Annotated[float, Field(ge=0, lt=1)] = 0.3
    #: Among candidate plans take the lightest whose predicted step time is within this
    #: fraction of the fastest; dense counts as the lightest, so compression must save more
    #: than this to be used. It is also the hysteresis band: the current plan is kept while
    #: it stays within it. While the fastest plan holds a collective family whose rounds
    #: are still priced at ``round_seconds``, compression must save twice this against
    #: dense: a saving predicted on the assumed overhead must be larger before compression
    #: starts on it. Raise it on noisy shared
    #: machines; lower it to squeeze the link.
    slack: Annotated[float, Field(ge=0, le=10)] = 0.1
    #: Seconds each extra collective round of a compressed plan costs (latency plus
    #: compression and decompression) until the run has measured it, per collective family
    #: (PowerSGD, Top-K, the int4/int8 batch, each cast): each is learned from the first
    #: compressed control interval it runs in. NCCL on one node: ~1e-4; gloo over TCP:
    #: ~1e-3; shared CPUs: more (measured on the CNN at 100 Mbit/s: int4 12-25 ms a
    #: round, PowerSGD under 1 ms; 90-121 and 18-38 ms before DDP's buckets overlapped
    #: backward and hidden time stopped counting). Being optimistic, it gets every family
    #: tried once.
    round_seconds: Annotated[float, Field(ge=0, le=10)] = 0.001
    #: Link bandwidth in bytes per second per rank to plan for, instead of measuring it on
    #: dense steps (warm-up, guard fallbacks). Set it when you know the link better than a
    #: short warm-up can measure it, or to plan for a target link (100 Mbit/s: 12.5e6).
    bandwidth: Annotated[float, Field(gt=0)] | None = None

    @field_validator("ranks", "topk_ratios")
    @classmethod
    def _ladder(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("at least one value is required")
        return sorted(set(values))  # heaviest first

    @model_validator(mode="after")
    def _some_rung(self) -> AdaptivePolicy:
        if self.sharded and not self.near_lossless:
            raise ValueError("sharded: true needs at least one near_lossless rung (int4, int8, bf16, fp16)")
        if self.lossy == "never" and not self.near_lossless:
            raise ValueError("lossy: never needs at least one near_lossless rung (int4, int8, bf16, fp16)")
        return self

    @field_validator("near_lossless")
    @classmethod
    def _near_lossless(cls, values: list[str]) -> list[str]:
        unique = list(dict.fromkeys(values))
        heaviest = {"int4": 0, "int8": 1}  # half a byte, one byte, then the casts (two)
        return sorted(unique, key=lambda name: heaviest.get(name, 2))


