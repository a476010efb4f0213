"""Min-max quantization per chunk: 8 bits (ByteGrad-like) and 4 bits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from raycomp._internal.wire.bitpack import pack_codes_into, packed_nbytes, unpack_bits_into
from raycomp._internal.wire.payload import Payload
from raycomp.compressors.base import Compressor, Cost, Transport, check_float_tensor, check_int

CPU_BLOCK_ELEMENTS = 1 << 18  # 1 MiB of fp32 per block


class MinMaxInt8(Compressor):
    """Uniform 8-bit quantization of each chunk of ``chunk_size`` elements between its
    own minimum and maximum, as in Bagua's ByteGrad (Gan et al., "BAGUA: Scaling up
    Distributed Learning with System Relaxations", VLDB 2022):

        q_i = round((x_i - min_c) / (max_c - min_c) * 255),   x_i ~ min_c + q_i * (max_c - min_c) / 255

    Nearest rounding is deterministic, so the compressor is biased and runs with error
    feedback. Wire: ``N`` bytes + two fp32 (min, max) per chunk.
    """

    name = "int8"
    transport = Transport.SCALABLE
    batches_layers = True
    #: bits per code; ``2**bits - 1`` steps between a chunk's minimum and maximum
    bits: ClassVar[int] = 8
    #: one batch of the scalable transport for every layer on int8 or int4: an all-to-all
    #: and an all-gather (at two ranks the all-gather alone)
    cost = Cost(near_lossless=True, rounds=2, rounds_at_two=1, family="quantized")

    def __init__(self, chunk_size: int = 2048) -> None:
        self.chunk_size = check_int("chunk_size", chunk_size, 8)

    def params(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size}

    def wire_bytes(self, numel: int) -> int:
        """Payload bytes for ``numel`` elements: the packed codes and two fp32 per chunk."""
        return packed_nbytes(numel, self.bits) + 8 * -(-numel // self.chunk_size)

    def payload_bytes(self, numel: int, shape: tuple[int, ...], element_size: float) -> float:
        return self.wire_bytes(numel)

    def _compress(self, flat: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        parts = self._whole_chunks(flat)
        x = parts[0] if len(parts) == 1 else torch.cat(parts)
        packed, bounds = self._quantize(x.view(-1, self.chunk_size), flat.numel())
        return Payload({"codes": packed, "bounds": bounds}, shape, dtype)

    def _whole_chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` in fp32 and, if its last chunk is short, the padding that fills it: its
        last value repeated, in range, so that the last chunk's range is its own."""
        x = flat.float()
        pad = (-x.numel()) % self.chunk_size
        return [x, x[-1:].expand(pad)] if pad else [x]

    def _quantize(self, chunks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed codes of the first ``n`` elements of ``chunks`` (fp32, one row per
        chunk), and each chunk's (min, max)."""
        low, high = chunks.amin(dim=1), chunks.amax(dim=1)  # not aminmax(dim=1): slower on the CPU
        span = high - low
        scale = torch.where(span > 0, (2**self.bits - 1) / span, 0.0)[:, None]
        offset = 0.5 - low[:, None] * scale  # + 0.5, then truncation by the uint8 cast = rounding
        per_byte = 8 // self.bits
        packed = torch.empty(packed_nbytes(n, self.bits), dtype=torch.uint8, device=chunks.device)
        rows = chunks.shape[0] if chunks.is_cuda else max(2, CPU_BLOCK_ELEMENTS // self.chunk_size // 2 * 2)
        rows = min(rows, chunks.shape[0])
        block_codes = torch.empty(rows * self.chunk_size, device=chunks.device)
        for start in range(0, chunks.shape[0], rows):
            # on CPU a block at a time (an even number of chunks: whole bytes), so the float
            # codes stay in cache instead of a gradient-sized temporary
            stop = min(start + rows, chunks.shape[0])
            first = start * self.chunk_size
            count = min(stop * self.chunk_size, n) - first  # the last chunk's padding is not sent
            block = block_codes[: (stop - start) * self.chunk_size].view(stop - start, self.chunk_size)
            torch.mul(chunks[start:stop], scale[start:stop], out=block).add_(offset[start:stop])
            written = packed[first // per_byte: first // per_byte + packed_nbytes(count, self.bits)]
            pack_codes_into(block.view(-1)[:count], self.bits, written)
        return packed, torch.stack([low, high], dim=1)

    def decompress(self, payload: Payload) -> torch.Tensor:
        n, size = payload.numel, self.chunk_size
        packed, bounds = payload.tensors["codes"], payload.tensors["bounds"]
        chunks = bounds.shape[0]
        # the codes as floats, straight from the bytes; what lies past the n-th (the last
        # chunk's padding, the zero code of a half byte) is decoded too, and cut off
        coded = packed.numel() * (8 // self.bits)
        flat = torch.empty(max(chunks * size, coded), device=bounds.device)
        unpack_bits_into(packed, self.bits, flat[:coded])
        self._dequantize(flat[: chunks * size].view(chunks, size), bounds)
        return flat[:n].to(payload.dtype).reshape(payload.shape)

    def _dequantize(self, codes: torch.Tensor, bounds: torch.Tensor) -> None:
        """The values of ``codes`` (fp32, one row per chunk), in place, from each chunk's
        (min, max) in ``bounds``."""
        low = bounds[:, 0:1]
        # in place, not addcmul: addcmul's broadcast of the per-chunk columns is slow on the CPU
        codes.mul_((bounds[:, 1:2] - low) / (2**self.bits - 1)).add_(low)

    # --- many layers at once ------------------------------------------------------------
    def compress_many(self, tensors: Sequence[torch.Tensor]) -> list[Payload]:
        """:meth:`compress` of each tensor, bit for bit; on a GPU all of them together
        (:meth:`_compress_together`). On the CPU one at a time: there a layer's ~30 small
        operations cost less than copying every layer into one buffer."""
        if not tensors or not self._together(len(tensors), tensors[0].device):
            return [self.compress(t) for t in tensors]
        return self._compress_together(tensors)

    def decompress_many(self, payloads: Sequence[Payload]) -> list[torch.Tensor]:
        """:meth:`decompress` of each payload, bit for bit; on a GPU all of them together
        (:meth:`_decompress_together`), on the CPU one at a time."""
        if not payloads or not self._together(len(payloads), payloads[0].tensors["codes"].device):
            return [self.decompress(p) for p in payloads]
        return self._decompress_together(payloads)

    def _compress_together(self, tensors: Sequence[torch.Tensor]) -> list[Payload]:
        """:meth:`compress` of each tensor, bit for bit, in one pass over all of them: each
        tensor padded to whole chunks (as :meth:`compress` pads its last one), the chunks
        quantized and packed together, each payload a view of its part. A layer costs a
        few GPU kernels instead of ~30, whose launches bound the per-layer path on CUDA."""
        self._check_aligned()
        for t in tensors:
            check_float_tensor(t)
        parts, offsets = [], [0]  # offsets: each tensor's first chunk
        for t in tensors:
            whole = self._whole_chunks(t.detach().reshape(-1))
            parts += whole
            offsets.append(offsets[-1] + sum(part.numel() for part in whole) // self.chunk_size)
        chunks = torch.cat(parts).view(-1, self.chunk_size)
        packed, bounds = self._quantize(chunks, chunks.numel())
        per_byte = 8 // self.bits
        payloads = []
        for i, t in enumerate(tensors):
            n, first = t.numel(), offsets[i] * self.chunk_size // per_byte
            codes = packed[first: first + packed_nbytes(n, self.bits)]
            if n % per_byte:  # the last byte's unused code: zero, as compress leaves it
                codes[-1:].bitwise_and_((1 << (n % per_byte) * self.bits) - 1)
            payloads.append(Payload({"codes": codes, "bounds": bounds[offsets[i]:offsets[i + 1]]}, t.shape, t.dtype))
        return payloads

    def _decompress_together(self, payloads: Sequence[Payload]) -> list[torch.Tensor]:
        """:meth:`decompress` of each payload, bit for bit, in one pass over all of them
        (their codes laid out chunk-aligned in one buffer); each result is a view of it."""
        self._check_aligned()
        per_byte, size = 8 // self.bits, self.chunk_size
        bounds = [p.tensors["bounds"] for p in payloads]
        slack = [b.shape[0] * size // per_byte - p.tensors["codes"].numel() for p, b in zip(payloads, bounds, strict=True)]
        zeros = torch.zeros(max(slack), dtype=torch.uint8, device=bounds[0].device)
        codes = torch.cat([part for p, extra in zip(payloads, slack, strict=True)
                           for part in (p.tensors["codes"], zeros[:extra])])
        flat = torch.empty(codes.numel() * per_byte, device=codes.device)
        unpack_bits_into(codes, self.bits, flat)
        self._dequantize(flat.view(-1, size), torch.cat(bounds))
        results, first = [], 0
        for p, b in zip(payloads, bounds, strict=True):
            results.append(flat[first: first + p.numel].to(p.dtype).reshape(p.shape))
            first += b.shape[0] * size
        return results

    def _together(self, count: int, device: torch.device) -> bool:
        """Whether :meth:`compress_many` / :meth:`decompress_many` of ``count`` layers on
        ``device`` take them together: several, aligned (:meth:`_aligned`), off the CPU."""
        return count > 1 and self._aligned() and device.type != "cpu"

    def _aligned(self) -> bool:
        """Whether every chunk starts on a whole byte of codes (int4 needs an even chunk)."""
        return self.chunk_size % (8 // self.bits) == 0

    def _check_aligned(self) -> None:
        if not self._aligned():
            raise ValueError(f"{self.name}: chunk_size {self.chunk_size} does not start every chunk on a whole "
                             f"byte of codes; layers are compressed together only with a multiple of {8 // self.bits}")


class MinMaxInt4(MinMaxInt8):
    """:class:`MinMaxInt8` at 4 bits: 15 steps between each chunk's minimum and maximum,
    two codes packed per byte. Unlike QSGD's stochastic 4-bit codes (Alistarh et al.,
    NeurIPS 2017) it rounds to the nearest code, so it is biased and runs with error
    feedback (Karimireddy et al., ICML 2019), like Top-K and PowerSGD.

    A step is 1/15 of the chunk's range instead of 1/255: relative error about 0.13 on a
    Gaussian chunk of 2,048 against int8's 0.008, which error feedback carries into the
    next steps. On a slow link half the bytes outweigh it: beside int8 it reaches the same
    loss target in the same steps and less time (``docs/benchmarks/history.md``, ``int4``).

    Wire: ``ceil(N / 2)`` bytes + two fp32 (min, max) per chunk.
    """

    name = "int4"
    bits = 4
