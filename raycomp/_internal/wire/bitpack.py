"""Packing small integer codes (1, 2, 4 or 8 bits each) densely into bytes.

Code ``i`` of a byte occupies bits ``[i*b, (i+1)*b)`` counting from the least
significant bit. 1-bit packing uses the multiply bit-gather trick on 64-bit words (eight
0/1 bytes -> one byte in one multiply), which is several times faster than shifting.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["ALLOWED_BITS", "pack_bits", "pack_codes_into", "packed_nbytes", "unpack_bits", "unpack_bits_into"]

ALLOWED_BITS = (1, 2, 4, 8)
#: 4-bit codes are paired through an int16 view of two bytes, whose value depends on the
#: machine's byte order; elsewhere the generic path runs
_PAIRS_AS_INT16 = sys.byteorder == "little"
_GATHER_1BIT = 0x0102040810204080  # byte i of a 0/1 word lands on bit 56 + i


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 (or bool) tensor of codes ``< 2**bits`` into bytes."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits: must be one of {ALLOWED_BITS}, got {bits!r}")
    codes = codes.reshape(-1)
    if codes.dtype == torch.bool:
        codes = codes.view(torch.uint8)
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.numel()
    if bits == 1:
        padded = _pad_to(codes, 8)
        if padded.storage_offset() % 8:  # a view as int64 needs an 8-byte-aligned start
            padded = padded.clone()
        words = padded.view(torch.int64)
        return ((words * _GATHER_1BIT) >> 56).to(torch.uint8)
    per_byte = 8 // bits
    grid = _pad_to(codes, per_byte).view(-1, per_byte)
    out = grid[:, 0].clone()
    for i in range(1, per_byte):
        out |= grid[:, i] << (i * bits)
    assert out.numel() == packed_nbytes(n, bits)
    return out


def pack_codes_into(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` written into ``out`` (uint8, ``packed_nbytes(codes.numel(), bits)``
    bytes), with the codes given as numbers of any dtype in ``[0, 2**bits)``: floats are
    truncated toward zero, as a cast does (add 0.5 first to round). Returns ``out``.

    4-bit codes on a little-endian machine take no strided pass: the codes are cast to
    bytes, two neighbours ``a, b`` read as one int16 ``v = a + 256 b``, and ``v | v >> 4``
    holds ``a + 16 b`` in its low byte, which the cast back to uint8 keeps. Every pass is
    contiguous, which is faster than assembling the bytes from strided float columns of
    the codes.
    """
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits: must be one of {ALLOWED_BITS}, got {bits!r}")
    n = codes.numel()
    if out.numel() != packed_nbytes(n, bits):
        raise ValueError(f"out: must hold {packed_nbytes(n, bits)} bytes, got {out.numel()}")
    if bits == 8:
        return out.copy_(codes.reshape(-1))
    if bits == 4 and _PAIRS_AS_INT16 and n:
        pairs = torch.empty(n + n % 2, dtype=torch.uint8, device=codes.device)
        pairs[:n].copy_(codes.reshape(-1))
        pairs[n:].zero_()  # an odd count's last byte: a zero code in the high half
        v = pairs.view(torch.int16)
        return out.copy_(v.bitwise_or(v >> 4))
    return out.copy_(pack_bits(codes.to(torch.uint8), bits))


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes as uint8."""
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits: must be one of {ALLOWED_BITS}, got {bits!r}")
    if bits == 8:
        return packed[:n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:n]


def unpack_bits_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`unpack_bits` written straight into ``out`` (any dtype, e.g. float32: the codes
    as numbers, no uint8 tensor of codes in between), which holds ``8 // bits`` codes per
    packed byte: ``out.numel() == packed.numel() * (8 // bits)``. Returns ``out``.

    One strided pass per code position: several times faster than :func:`unpack_bits`
    and a cast (whose broadcast shift has an inner dimension of two). 4-bit codes on a
    little-endian machine spread each byte over an int16 instead, the inverse of
    :func:`pack_codes_into`'s pairing, and are cast in one contiguous pass, faster again
    than the strided passes.
    """
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits: must be one of {ALLOWED_BITS}, got {bits!r}")
    per_byte = 8 // bits
    if out.numel() != packed.numel() * per_byte:
        raise ValueError(f"out: must hold {packed.numel() * per_byte} codes, got {out.numel()}")
    if bits == 4 and _PAIRS_AS_INT16 and packed.numel():  # byte a + 16 b -> int16 a + 256 b: the bytes a, b
        pairs = torch.empty(packed.numel(), dtype=torch.int16, device=packed.device).copy_(packed)  # stride 1
        pairs.bitwise_or_(pairs << 4).bitwise_and_(0x0F0F)
        return out.copy_(pairs.view(torch.uint8))
    grid = out.view(-1, per_byte)
    mask = (1 << bits) - 1
    for i in range(per_byte):
        code = packed >> (i * bits) if i else packed
        if i < per_byte - 1:  # the top code has no bits above it to mask
            code = code & mask
        grid[:, i].copy_(code)
    return out


def _pad_to(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    # a view-friendly contiguous uint8 tensor whose length is a multiple of `multiple`
    codes = codes.to(torch.uint8).contiguous()
    extra = (-codes.numel()) % multiple
    if extra:
        codes = torch.cat([codes, codes.new_zeros(extra)])
    return codes
