"""8-bit min-max quantization per chunk (ByteGrad-like)."""

from __future__ import annotations

from typing import Any

import torch

from raycomp.compressors.base import Compressor, Transport, check_int
from raycomp.payload import Payload


class MinMaxInt8(Compressor):
    """Uniform 8-bit quantization of each chunk of ``chunk_size`` elements between its
    own minimum and maximum, as in Bagua's ByteGrad (Gan et al., "BAGUA: Scaling up
    Distributed Learning with System Relaxations", VLDB 2022):

        q_i = round((x_i - min_c) / (max_c - min_c) * 255),   x_i ~ min_c + q_i * (max_c - min_c) / 255

    Wire: ``N`` bytes + two fp32 (min, max) per chunk.
    """

    name = "int8"
    transport = Transport.SCALABLE

    def __init__(self, chunk_size: int = 2048) -> None:
        self.chunk_size = check_int("chunk_size", chunk_size, 8)

    def params(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size}

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        x = flat.float()
        n = x.numel()
        pad = (-n) % self.chunk_size
        if pad:  # pad with an in-range value so the last chunk's range is its own
            x = torch.cat([x, x[-1:].expand(pad)])
        chunks = x.view(-1, self.chunk_size)
        low, high = torch.aminmax(chunks, dim=1)
        step = (high - low) / 255
        step = torch.where(step > 0, step, 1.0)
        # one temporary, then in place: this runs over every gradient element
        codes = (chunks - low[:, None]).div_(step[:, None]).round_().clamp_(0, 255).to(torch.uint8)
        bounds = torch.stack([low, high], dim=1)
        return Payload({"codes": codes.reshape(-1)[:n], "bounds": bounds}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        codes, bounds = payload.tensors["codes"], payload.tensors["bounds"]
        n = payload.numel
        pad = (-n) % self.chunk_size
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad)])
        low, high = bounds[:, 0:1], bounds[:, 1:2]
        values = torch.addcmul(low, codes.view(-1, self.chunk_size).float(), (high - low) / 255)
        return values.reshape(-1)[:n].to(payload.dtype).reshape(payload.shape)
