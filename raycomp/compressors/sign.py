"""Scaled sign (1-bit) compression, used with error feedback."""

from __future__ import annotations

import torch

from raycomp._internal.wire.bitpack import pack_bits, unpack_bits
from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Transport


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
        scale = (torch.linalg.vector_norm(flat.float(), ord=1) / flat.numel()).reshape(1)
        return Payload({"bits": pack_bits(flat >= 0, 1), "scale": scale}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        bits = unpack_bits(payload.tensors["bits"], 1, payload.numel)
        scale = payload.tensors["scale"].to(payload.dtype)
        return torch.where(bits.bool(), scale, -scale).reshape(payload.shape)
