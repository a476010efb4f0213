"""No compression: the gradient travels as it is (plain all-reduce)."""

from __future__ import annotations

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Cost, Transport


class Dense(Compressor):
    """The identity; the plan's way to say "all-reduce this layer uncompressed"."""

    name = "none"
    transport = Transport.DENSE
    unbiased = True
    lossy = False
    cost = Cost(near_lossless=True, rounds=0)  # the all-reduce the measured bandwidth includes

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        return element_size * numel

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        return Payload({"values": flat}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["values"].reshape(payload.shape)
