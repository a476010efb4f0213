"""Cheap per-layer gradient statistics, measured on the steps the controller asks for.

Three norms per layer, each one pass over tensors the reducer already holds:
gradient norm, relative compression error ``||c - sent|| / ||c||`` (``c`` the
error-compensated gradient) and the error-feedback residual norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["LayerStats", "PROFILE_SAMPLES", "layer_stats", "topk_error_profile"]

PROFILE_SAMPLES = 65_536


@dataclass
class LayerStats:
    layer: str
    compressor: str
    numel: int
    grad_norm: float
    compression_error: float  # relative; 0 for dense
    residual_norm: float
    wire_bytes: float
    dense_bytes: float
    #: relative error Top-K would have at candidate ratios (str(ratio) -> error)
    topk_errors: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        # not dataclasses.asdict: its deep copy of every field cost ~0.2 ms a layer, at
        # every control boundary
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["topk_errors"] = dict(self.topk_errors)
        return out


def layer_stats(
    layer: str,
    compressor: str,
    grad: torch.Tensor,
    compensated: torch.Tensor,
    sent: torch.Tensor,
    residual: torch.Tensor | None,
    wire_bytes: float,
    dense_bytes: float,
    profile_ratios: tuple[float, ...] = (),
    unscale: float = 1.0,
) -> LayerStats:
    """``unscale``: the loss scale the gradients carry (``raycomp._internal.reduce.loss_scale``); the norms
    are reported divided by it, in the loss's units."""
    norm = torch.linalg.vector_norm
    zero = compensated.new_zeros((), dtype=torch.float32)
    of_compensated = norm(compensated.float())
    norms = [of_compensated,
             of_compensated if compensated is grad else norm(grad.float()),  # no residual: the same norm
             zero if sent is compensated else norm(compensated.float() - sent.float()),
             zero if residual is None else norm(residual)]
    # one host read for the layer's norms, not one each (on CUDA each read waits for the device)
    compensated_norm, grad_norm, error_norm, residual_norm = torch.stack(
        [n.float().to(zero.device) for n in norms]).tolist()
    error = error_norm / compensated_norm if compensated_norm > 0 else 0.0  # 0 when all was sent
    return LayerStats(
        layer=layer,
        compressor=compressor,
        numel=grad.numel(),
        grad_norm=grad_norm / unscale,
        compression_error=error,
        residual_norm=residual_norm / unscale,
        wire_bytes=wire_bytes,
        dense_bytes=dense_bytes,
        topk_errors=topk_error_profile(compensated, profile_ratios) if profile_ratios else {},
    )


def topk_error_profile(x: torch.Tensor, ratios: tuple[float, ...]) -> dict[str, float]:
    """Relative error ``||x - topk_r(x)|| / ||x||`` for each ratio, from one sort.

    Large tensors are measured on an evenly strided sample of ``PROFILE_SAMPLES``
    elements (deterministic, identical for the same tensor), which estimates the energy
    fraction in the tail well for the ratios policies use (>= 1e-3 of the sample).
    """
    sample = x.detach().reshape(-1).float()
    if sample.numel() > PROFILE_SAMPLES:
        sample = sample[:: sample.numel() // PROFILE_SAMPLES][:PROFILE_SAMPLES]
    energy = sample.square().sort(descending=True).values.cumsum(0)
    total = float(energy[-1]) if energy.numel() else 0.0
    out = {}
    for ratio in ratios:
        if total <= 0:
            out[str(ratio)] = 0.0
            continue
        k = max(1, min(energy.numel(), math.ceil(ratio * energy.numel())))
        out[str(ratio)] = math.sqrt(max(0.0, 1.0 - float(energy[k - 1]) / total))
    return out
