"""One compressor for every layer, all run long."""

from __future__ import annotations

from controllers.policies.base import Policy, PolicyOptions, spec
from controllers.state import RunState
from raycomp.config.base import CompressorConfig, compressor
from raycomp.plan import Plan


class StaticOptions(PolicyOptions):
    """``compression.static``: the one compressor."""

    not_shardable = None
    compressor: CompressorConfig = compressor("topk", ratio=0.01)

    def check_sharded(self, key: str) -> None:
        self.check_fits_a_shard(f"{key}.compressor", self.compressor)


class StaticPolicy(Policy):
    name = "static"
    options_model = StaticOptions
    options: StaticOptions

    def decide(self, run: RunState) -> Plan:
        return Plan(default=spec(self.options.compressor), reason="static")


__all__ = ["StaticOptions", "StaticPolicy"]
