"""``compression``: the policy and its options, the warm-up, the error-feedback memory, and
the sections it holds (the guard, the LR ramp, local steps, each built-in policy's options)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raycomp.config import policy_sections
from raycomp.config.base import Strict
from raycomp.config.guard import GuardSection
from raycomp.config.local import SPARSELOCO, LocalSection
from raycomp.config.lr_scaling import LrScalingSection


class CompressionSection(Strict):
    """``compression``: the policy and its options, the warm-up, the error-feedback
    memory, the guard and the LR ramp.

    Besides its fields it holds one section per built-in policy, named after it
    (``compression.adaptive``, ``compression.static``, ...: the policy's typed options,
    :mod:`raycomp.config.policy_options`; see :mod:`raycomp.config.policy_sections`).
    """

    config_key = "compression"

    model_config = policy_sections.SECTION_CONFIG
    #: a built-in policy (``adaptive``, the default), a name registered with
    #: ``raycomp.controllers.policies.register_policy``, or an import path ``package.module:Class``
    #: that the controller imports (docs/extending.md)
    policy: str = "adaptive"
    #: options of a policy that is not built in, validated by its options model (built-in
    #: policies take theirs from their own section, e.g. ``compression.adaptive``)
    custom_options: dict[str, Any] = {}
    #: steps before the policy's own choice: dense, or under the adaptive policy near-lossless
    #: once its first (early) control boundary has timed the link (``compression.adaptive.warmup``)
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    #: the error-feedback memory. "residual": what compression dropped is added to the next
    #: step's gradient; "dgc": DGC's momentum correction (run the optimizer without
    #: momentum); "none": dropped is lost
    memory: Literal["residual", "dgc", "none"] = "residual"
    #: layers with fewer elements always go dense (latency dominates their cost)
    min_compress_numel: Annotated[int, Field(ge=0)] = 1024
    #: "auto" (default): where Ray Train places several workers on each of several nodes,
    #: compressed steps reduce in two levels, dense inside each node and compressed across
    #: nodes, one piece per worker of the node (raycomp._internal.reduce.two_level); one node, or one worker
    #: per node, is the flat path. "flat": every worker is its own node. A checkpoint
    #: restored at another size or layout merges every worker's pieces
    #: (raycomp._internal.train.resize). Under local steps a replica is then a node: inner steps
    #: data-parallel inside it, syncs across nodes in pieces
    levels: Literal["flat", "auto"] = "auto"
    #: the dense fallback: see :class:`GuardSection`
    guard: GuardSection = GuardSection()
    #: the LR ramp after a dense -> compressed switch: see :class:`LrScalingSection`
    lr_scaling: LrScalingSection = LrScalingSection()
    #: local steps (``mode: off`` by default): see :class:`LocalSection`
    local: LocalSection = LocalSection()
    #: DDP ``bucket_cap_mb`` (MB of gradients per bucket) of the run's DDP model. The hook
    #: sends each bucket while backward computes the next (decoding it once its collectives
    #: complete), so smaller buckets hide more of the wire behind backward; each costs a round.
    #: "auto": about 8 buckets, between DDP's 1 MB first bucket and its 25 MB default
    #: (raycomp.bucket_cap_mb; a model of 200 MB+ keeps DDP's 25 MB). FSDP
    #: (scaling.strategy=fsdp) has no DDP buckets and ignores it
    bucket_cap_mb: float | Literal["auto"] = "auto"

    @field_validator("bucket_cap_mb", mode="before")
    @classmethod
    def _bucket_cap(cls, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not 0 < number <= 100_000:
            raise ValueError(f"must be 'auto' or a size in MB in (0, 100000], got {value!r}")
        return number

    @model_validator(mode="before")
    @classmethod
    def _policy_sections(cls, data: Any) -> Any:
        return policy_sections.split_sections(data, set(cls.model_fields)) if isinstance(data, dict) else data

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, name: str, info: ValidationInfo) -> str:
        return policy_sections.check_policy_name(name, policy_sections.registry_of(info))

    @model_validator(mode="after")
    def _custom_options(self, info: ValidationInfo) -> CompressionSection:
        policy_sections.check_custom_options(self.policy, self.custom_options, policy_sections.registry_of(info))
        return self

    @model_validator(mode="after")
    def _sparseloco_memory(self) -> CompressionSection:
        if self.local.mode != "off" and self.local.compressor == SPARSELOCO and self.memory == "none":
            raise ValueError(f"memory: 'none' drops the error feedback of local.compressor {SPARSELOCO!r}, "
                             "which replaces its outer momentum; allowed: residual")
        return self

    def check_strategy(self, strategy: str) -> None:
        """ValueError (one line) unless this compression can run with ``strategy``: with
        ``fsdp`` every compressor it may choose must fit a reduce-scatter row."""
        if strategy != "fsdp":
            return
        if self.local.mode != "off":
            raise ValueError(f"compression.local.mode: {self.local.mode!r} is not available with "
                             "scaling.strategy=fsdp (local steps keep a full copy of the weights); allowed: off")
        policy_sections.check_sharded_policy(self)
        if self.memory == "dgc":
            raise ValueError("compression.memory: 'dgc' is not available with scaling.strategy=fsdp; "
                             "allowed: residual, none")
        policy_sections.check_sharded_options(self)

    def policy_options(self) -> dict[str, Any]:
        """The options the controller gets for ``policy`` (JSON), with ``local`` unless its
        mode is off."""
        options = policy_sections.options_of(self)
        if self.local.mode != "off":
            options = {**options, "local": self.local.model_dump(mode="json")}
        return options


__all__ = ["CompressionSection"]
