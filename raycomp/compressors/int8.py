"""8-bit min-max quantization per chunk (ByteGrad-like)."""

from __future__ import annotations

from typing import Any

import torch

from raycomp.compressors.base import Compressor, Transport, check_int
from raycomp.payload import Payload

CPU_BLOCK_ELEMENTS = 1 << 18  # 1 MiB of fp32 per block


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
        low, high = chunks.amin(dim=1), chunks.amax(dim=1)  # 6x faster here than aminmax(dim=1)
        span = high - low
        scale = torch.where(span > 0, 255 / span, 0.0)[:, None]
        offset = 0.5 - low[:, None] * scale  # + 0.5, then truncation by the uint8 cast = rounding
        codes = torch.empty(chunks.shape, dtype=torch.uint8, device=chunks.device)
        rows = chunks.shape[0] if chunks.is_cuda else max(1, CPU_BLOCK_ELEMENTS // self.chunk_size)
        buffer = torch.empty(min(rows, chunks.shape[0]), self.chunk_size, device=chunks.device)
        for start in range(0, chunks.shape[0], rows):
            # on CPU a block at a time: the float intermediate stays in cache instead of
            # a gradient-sized temporary (0.86 -> 2.2 GB/s at 16M elements here)
            stop = min(start + rows, chunks.shape[0])
            block = buffer[: stop - start]
            torch.addcmul(offset[start:stop], chunks[start:stop], scale[start:stop], out=block)
            codes[start:stop].copy_(block)
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
