"""Half-precision casts: fp16 and bf16 payloads, summed directly by all-reduce.

Like torch's ``fp16_compress_hook`` / ``bf16_compress_hook``; the collective divides by the
world size *before* the cast so that the fp16 sum cannot overflow.
"""

from __future__ import annotations

import torch

from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Cost, Transport


class Cast(Compressor):
    """A cast to :attr:`wire_dtype`, summed by the all-reduce as it is (the summable
    transport divides, casts and decodes a batch of them in one buffer)."""

    transport = Transport.ALLREDUCE
    lossy = False  # rounding only; error feedback would chase noise
    carries_nonfinite = True  # NaN and Inf survive the cast and the sum
    wire_dtype: torch.dtype
    cost = Cost(near_lossless=True, rounds=1)  # its own all-reduce

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        return self.wire_dtype.itemsize * numel

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        return Payload({"values": flat.to(self.wire_dtype)}, shape, dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["values"].to(payload.dtype).reshape(payload.shape)


class Fp16(Cast):
    """IEEE half precision (2 bytes per element)."""

    name = "fp16"
    wire_dtype = torch.float16


class Bf16(Cast):
    """bfloat16 (2 bytes per element, fp32's exponent range)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
