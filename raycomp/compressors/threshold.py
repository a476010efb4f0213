"""Fixed-threshold sparsification."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Transport, check_positive
from raycomp.compressors.sparse import scatter_dense, sparse_payload


class Threshold(Compressor):
    """Send every element with ``|x| >= threshold``; the rest waits in error feedback.

    Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
    Interspeech 2015. Payload size varies with the data: values + int32 indices.
    ``threshold`` is in the loss's units: under fp16 loss scaling the scaled gradient is
    compared with ``threshold`` times the scale (``loss_scale``), so a GradScaler leaves
    the choice as it is (compared with ``threshold`` itself, at a scale of 65,536 nearly
    every element would pass).
    """

    name = "threshold"
    transport = Transport.ALLGATHER
    sparse = True
    variable_size = True

    def __init__(self, threshold: float = 1e-3) -> None:
        self.threshold = check_positive("threshold", threshold)

    def params(self) -> dict[str, Any]:
        return {"threshold": self.threshold}

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        bar = self.threshold if self.loss_scale is None else self.threshold * self.loss_scale.to(flat.device)
        indices = torch.nonzero(flat.abs() >= bar).squeeze(1)
        return sparse_payload(flat, indices, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return scatter_dense(payload)
