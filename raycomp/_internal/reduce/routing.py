"""Routing, the first step of a compressed reduction: each layer's compressor under the plan,
and the transport its payload travels by.

Tiny layers (below ``min_compress_numel``), layers the compressor does not accept (1-D
ones for PowerSGD, say) and quantized layers with fewer elements than ranks go dense. The
answer is the same on every rank: it depends only on the plan, the layer's name and shape,
and the world size. The compressors built here keep state across steps (their random draws,
PowerSGD's factors), which checkpoints with the reducer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raycomp._internal.transports import Group
from raycomp.compressors import Compressor, Transport
from raycomp.plan import CompressorSpec, Plan

__all__ = ["Router"]


class Router:
    """Each layer's compressor and transport under a plan, kept until the plan changes.

    Args:
        group: the group the reduction spans (its rank seeds the compressors, its size
            decides which quantized layers are too small).
        min_compress_numel: layers with fewer elements always go dense.
        seed: base seed for compressors' random draws.
    """

    def __init__(self, group: Group, min_compress_numel: int, seed: int) -> None:
        self.group = group
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        #: each layer's compressor, with the spec it was built from (rebuilt when the spec changes)
        self.compressors: dict[str, tuple[CompressorSpec, Compressor]] = {}
        #: :meth:`route`'s answers under ``_routes_plan`` (the compressors of ``compressors``)
        self._routes: dict[tuple[str, ...], tuple[list[Compressor], list[Transport]]] = {}
        self._routes_plan: Plan | None = None

    def compressor_for(self, plan: Plan, layer: str) -> Compressor:
        spec = plan.spec_for(layer)
        cached = self.compressors.get(layer)
        if cached is None or cached[0] != spec:
            cached = (spec, spec.build(layer, self.group.rank, self.seed))
            self.compressors[layer] = cached
        return cached[1]

    def transport_for(self, plan: Plan, layer: str, shape: torch.Size) -> Transport:
        compressor = self.compressor_for(plan, layer)
        numel = shape.numel()
        if numel < max(1, self.min_compress_numel) or not compressor.accepts(shape):
            return Transport.DENSE
        if compressor.transport is Transport.SCALABLE and numel < self.group.size:
            return Transport.DENSE
        return compressor.transport

    def route(self, plan: Plan, names: Sequence[str], grads: Sequence[torch.Tensor],
              loss_scale: torch.Tensor | None) -> tuple[list[Compressor], list[Transport]]:
        """Each layer's compressor, told this step's ``loss_scale``, and its transport; kept
        per plan and list of layers (a DDP bucket's are the same every step), since routing
        every layer of every bucket again cost ~60 us a bucket on the hot path."""
        for name, grad in zip(names, grads, strict=True):
            if not grad.is_floating_point():
                raise ValueError(f"gradient {name!r}: dtype {grad.dtype} is not floating point")
        if self._routes_plan is not plan:
            self._routes, self._routes_plan = {}, plan
        key = tuple(names)
        route = self._routes.get(key)
        if route is None:
            route = ([self.compressor_for(plan, name) for name in names],
                     [self.transport_for(plan, name, grad.shape) for name, grad in zip(names, grads, strict=True)])
            self._routes[key] = route
        compressors, kinds = list(route[0]), list(route[1])
        for compressor in compressors:
            compressor.loss_scale = loss_scale  # None without a GradScaler
        return compressors, kinds

    # --- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each layer's compressor: its spec and its state."""
        return {name: {"spec": spec.to_dict(), "state": comp.state_dict()}
                for name, (spec, comp) in self.compressors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressors = {}
        for name, entry in state.items():
            spec = CompressorSpec.from_dict(entry["spec"])
            compressor = spec.build(name, self.group.rank, self.seed)
            compressor.load_state_dict(entry["state"])
            self.compressors[name] = (spec, compressor)
