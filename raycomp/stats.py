"""Cheap per-layer gradient statistics, measured on the steps the controller asks for.

Three norms per layer, each one pass over tensors the reducer already holds:
gradient norm, relative compression error ``||c - sent|| / ||c||`` (``c`` the
error-compensated gradient) and the error-feedback residual norm.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def layer_stats(
    layer: str,
    compressor: str,
    grad: torch.Tensor,
    compensated: torch.Tensor,
    sent: torch.Tensor,
    residual: torch.Tensor | None,
    wire_bytes: float,
    dense_bytes: float,
) -> LayerStats:
    norm = torch.linalg.vector_norm
    compensated_norm = float(norm(compensated.float()))
    error = 0.0
    if sent is not compensated and compensated_norm > 0:
        error = float(norm(compensated.float() - sent.float())) / compensated_norm
    return LayerStats(
        layer=layer,
        compressor=compressor,
        numel=grad.numel(),
        grad_norm=float(norm(grad.float())),
        compression_error=error,
        residual_norm=0.0 if residual is None else float(norm(residual)),
        wire_bytes=wire_bytes,
        dense_bytes=dense_bytes,
    )
