"""Scaled sign (1-bit) compression, used with error feedback."""

from __future__ import annotations

import torch

from raycomp.bitpack import pack_bits, unpack_bits
from raycomp.compressors.base import Compressor, Transport
from raycomp.payload import Payload


class ScaledSign(Compressor):
    """Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
    Schemes", ICML 2019, Algorithm 1 (EF-SignSGD):

        C(x) = (||x||_1 / N) * sign(x)

    The signs travel as bits packed 8 per byte (``x >= 0`` -> 1). Biased: use with error
    feedback (the default in the hook). Wire: ``ceil(N / 8)`` bytes + one fp32 scale.
    """

    name = "sign"
    transport = Transport.SCALABLE

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        scale = flat.float().abs().mean().reshape(1)
        return Payload({"bits": pack_bits(flat >= 0, 1), "scale": scale}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        bits = unpack_bits(payload.tensors["bits"], 1, payload.numel)
        values = (bits.float() * 2 - 1) * payload.tensors["scale"]
        return values.to(payload.dtype).reshape(payload.shape)
