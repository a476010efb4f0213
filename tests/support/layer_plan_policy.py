"""A test policy: one fixed compressor per layer, the same plan at every decision.

Named by its import path (``compression.policy="tests.support.layer_plan_policy:LayerPlanPolicy"``,
no registration needed), its options in ``compression.custom_options``: ``layers`` (parameter
name -> compressor by registry name with its parameters) and ``default`` (every other layer;
dense unless given). With ``compression.warmup_steps=0`` the controller decides this plan when
the run registers, before step 0, and every later decision is the same plan (the controller
drops repeats): the plan in force at every step does not depend on when the controller
answers. tests/test_switch_modes.py's DDP resume drill runs three transports' compressors at
once this way (PowerSGD, int4, DGC's Top-K), so a killed run and an unbroken one step
under the same plan at every step.
"""

from __future__ import annotations

from raycomp.config.base import CompressorConfig, compressor
from raycomp.controllers.policies import Decision, Policy, PolicyOptions, Said
from raycomp.controllers.state import RunState
from raycomp.plan import Plan


class LayerPlanOptions(PolicyOptions):
    """``compression.custom_options`` of the layer-plan policy."""

    #: each named layer's compressor (parameter names as the run registers them, e.g. ``0.weight``)
    layers: dict[str, CompressorConfig]
    #: the compressor of every layer ``layers`` does not name
    default: CompressorConfig = compressor("none")


class LayerPlanPolicy(Policy):
    name = "layer_plan"
    options_model = LayerPlanOptions
    options: LayerPlanOptions

    def decide(self, run: RunState) -> Decision:
        unknown = sorted(set(self.options.layers) - set(run.layers))
        if unknown:  # a misspelt layer would silently take the default
            raise ValueError(f"custom_options.layers: no layer {unknown[0]!r} in the run; it has {sorted(run.layers)}")
        plan = Plan.per_layer({name: config.spec() for name, config in self.options.layers.items()},
                              default=self.options.default.spec())
        return Decision.of(plan, Said("layer_plan", "a fixed compressor per layer"))
