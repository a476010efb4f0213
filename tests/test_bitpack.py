"""Dense packing of 1/2/4/8-bit codes (raycomp._internal.wire.bitpack)."""

from __future__ import annotations

import math

import pytest
import torch

from raycomp._internal.wire.bitpack import (
    ALLOWED_BITS,
    pack_bits,
    pack_codes_into,
    packed_nbytes,
    unpack_bits,
    unpack_bits_into,
)

LENGTHS = [0, 1, 7, 8, 9, 1000, 100003]


def _codes(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 31 * n + bits)
    return torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.uint8)


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """Code i of a byte sits at bits [i*b, (i+1)*b) counted from the least significant bit."""
    per_byte = 8 // bits
    out = []
    for start in range(0, len(codes), per_byte):
        byte = 0
        for i, code in enumerate(codes[start : start + per_byte]):
            byte |= code << (i * bits)
        out.append(byte)
    return out


def test_allowed_bits() -> None:
    assert ALLOWED_BITS == (1, 2, 4, 8)


@pytest.mark.parametrize("bits", ALLOWED_BITS)
@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_and_size(bits: int, n: int) -> None:
    codes = _codes(n, bits)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.dim() == 1
    assert packed.numel() == math.ceil(n * bits / 8) == packed_nbytes(n, bits)
    unpacked = unpack_bits(packed, bits, n)
    assert unpacked.dtype == torch.uint8
    assert torch.equal(unpacked, codes)


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_empty_input_gives_empty_output(bits: int) -> None:
    packed = pack_bits(torch.empty(0, dtype=torch.uint8), bits)
    assert packed.shape == (0,) and packed.dtype == torch.uint8
    assert unpack_bits(packed, bits, 0).shape == (0,)


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_bit_order_matches_reference(bits: int) -> None:
    # 13 codes: several full bytes plus a partial last byte (padded with zero codes)
    codes = _codes(13, bits, seed=5).tolist()
    codes[0] = 2**bits - 1  # exercise the top code, and bit 7 (sign bit of the int64 trick)
    codes[7] = 2**bits - 1
    packed = pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    assert packed.tolist() == _reference_pack(codes, bits)


def test_bit_order_hand_checked() -> None:
    one_bit = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_bits(one_bit, 1).tolist() == [0b1000_0001, 0b0000_0001]
    two_bit = torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8)
    assert pack_bits(two_bit, 2).tolist() == [0b00_11_10_01, 0b11]
    four_bit = torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8)
    assert pack_bits(four_bit, 4).tolist() == [0x5A, 0x0F]


@pytest.mark.parametrize("n", [1, 8, 9, 64, 1001])
def test_one_bit_every_position_set(n: int) -> None:
    codes = torch.ones(n, dtype=torch.uint8)
    packed = pack_bits(codes, 1)
    full, rest = divmod(n, 8)
    assert packed[:full].tolist() == [0xFF] * full
    if rest:
        assert packed[-1].item() == (1 << rest) - 1
    assert torch.equal(unpack_bits(packed, 1, n), codes)


def test_bool_input_for_one_bit() -> None:
    mask = torch.randn(1003, generator=torch.Generator().manual_seed(1)) >= 0
    packed = pack_bits(mask, 1)
    assert packed.numel() == 126
    assert torch.equal(unpack_bits(packed, 1, mask.numel()), mask.to(torch.uint8))


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_views_with_offset_and_strides(bits: int) -> None:
    base = _codes(1000, bits, seed=9)
    # base[3:803]: 800 codes starting 3 bytes into the storage, so no padding copy is made
    views = (base[3:], base[3:803], base[5:12], base[::3], base.view(10, 100)[:, 1:].t())
    for view in views:
        packed = pack_bits(view, bits)
        assert torch.equal(unpack_bits(packed, bits, view.numel()), view.reshape(-1))


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_unpack_from_offset_buffer(bits: int) -> None:
    # payload buffers hand unpack_bits a slice of a larger byte buffer
    codes = _codes(77, bits, seed=3)
    packed = pack_bits(codes, bits)
    buffer = torch.cat([torch.full((3,), 0xFF, dtype=torch.uint8), packed])
    assert torch.equal(unpack_bits(buffer[3:], bits, 77), codes)


def test_unpack_returns_only_n_codes() -> None:
    packed = pack_bits(torch.tensor([1, 1, 1], dtype=torch.uint8), 2)
    assert unpack_bits(packed, 2, 2).tolist() == [1, 1]
    assert unpack_bits(packed, 2, 4).tolist() == [1, 1, 1, 0]  # padding codes are zero


@pytest.mark.parametrize("bits", [0, 3, 5, 16, -1])
def test_invalid_bits_raise(bits: int) -> None:
    codes = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"bits: must be one of \(1, 2, 4, 8\)"):
        pack_bits(codes, bits)
    with pytest.raises(ValueError, match=r"bits: must be one of \(1, 2, 4, 8\)"):
        unpack_bits(codes, bits, 4)


@pytest.mark.parametrize("bits", ALLOWED_BITS)
@pytest.mark.parametrize("n", LENGTHS)
def test_unpack_into_floats_gives_the_codes_and_zero_padding(bits: int, n: int) -> None:
    codes = _codes(n, bits, seed=3)
    packed = pack_bits(codes, bits)
    out = torch.full((packed.numel() * (8 // bits),), -1.0)
    assert unpack_bits_into(packed, bits, out) is out
    assert torch.equal(out[:n], codes.float())
    assert torch.equal(out[n:], torch.zeros(out.numel() - n))  # pack_bits pads with zero codes


def test_unpack_into_names_the_size_it_needs() -> None:
    with pytest.raises(ValueError, match=r"^out: must hold 6 codes, got 5$"):
        unpack_bits_into(torch.zeros(3, dtype=torch.uint8), 4, torch.empty(5))


@pytest.mark.parametrize("bits", ALLOWED_BITS)
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_codes_into_truncates_float_codes_and_packs_like_pack_bits(bits: int, n: int) -> None:
    codes = _codes(n, bits, seed=7)
    fraction = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 0.999  # truncated away
    out = torch.full((packed_nbytes(n, bits),), 0xEE, dtype=torch.uint8)
    assert pack_codes_into(codes.float() + fraction, bits, out) is out
    assert out.tolist() == _reference_pack(codes.tolist(), bits)  # an odd tail: zero high codes


def test_pack_codes_into_pairs_neighbours_low_half_first() -> None:
    out = torch.empty(3, dtype=torch.uint8)
    pack_codes_into(torch.tensor([10.0, 5.0, 15.0, 0.0, 9.0]), 4, out)
    assert out.tolist() == [0x5A, 0x0F, 0x09]
    back = torch.empty(6)
    assert unpack_bits_into(out, 4, back).tolist() == [10.0, 5.0, 15.0, 0.0, 9.0, 0.0]


def test_pack_codes_into_names_the_size_it_needs() -> None:
    with pytest.raises(ValueError, match=r"^out: must hold 3 bytes, got 2$"):
        pack_codes_into(torch.zeros(5), 4, torch.empty(2, dtype=torch.uint8))
