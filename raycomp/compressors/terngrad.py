"""TernGrad: stochastic ternary gradients {-s, 0, +s}."""

from __future__ import annotations

from typing import Any

import torch

from raycomp._internal.wire.bitpack import pack_bits, unpack_bits
from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, SeededDraws, Transport


class TernGrad(Compressor):
    """Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
    Deep Learning", NeurIPS 2017, Eq. 4:

        s = max_i |x_i|,   t_i = s * sign(x_i) * b_i,   b_i ~ Bernoulli(|x_i| / s)

    which is unbiased. Codes ``sign * b + 1`` in {0, 1, 2} are packed 4 per byte.
    Wire: ``ceil(N / 4)`` bytes + one fp32 scale. (The paper's optional gradient clipping
    is left out: it biases the estimate.)
    """

    name = "terngrad"
    transport = Transport.SCALABLE
    unbiased = True

    def __init__(self, seed: int = 0) -> None:
        self._draws = SeededDraws(seed)

    def params(self) -> dict[str, Any]:
        return {"seed": self._draws.seed}

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        x = flat.float()
        scale = x.abs().max()
        probability = x.abs() / torch.where(scale > 0, scale, 1.0)
        noise = torch.rand(x.shape, generator=self._draws.generator(x.device), device=x.device)
        keep = (noise < probability).float()
        codes = (keep.copysign_(x) + 1).to(torch.uint8)
        return Payload({"codes": pack_bits(codes, 2), "scale": scale.reshape(1)}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        codes = unpack_bits(payload.tensors["codes"], 2, payload.numel)
        values = (codes.float() - 1) * payload.tensors["scale"]
        return values.to(payload.dtype).reshape(payload.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"draws": self._draws.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._draws.load_state_dict(state["draws"])
