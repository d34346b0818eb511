"""Tests for kvbench.quant.packing: round trips, byte counts and hand-computed bytes."""

from __future__ import annotations

import pytest
import torch

from kvbench.quant.packing import chunk_layout, pack, packed_bits_per_code, packed_length, unpack

LEVELS = [*range(2, 17), 32, 64, 255, 256]


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("n", [0, 1, 7, 64, 65, 127])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_round_trip(levels, n, lead):
    # Fresh random codes each run; include both extreme codes so the top digit is exercised.
    codes = torch.randint(0, levels, (*lead, n), dtype=torch.uint8)
    if n >= 2:
        codes[..., 0] = levels - 1
        codes[..., -1] = levels - 1
    packed = pack(codes, levels)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_length(n, levels))
    out = unpack(packed, levels, n)
    assert out.dtype == torch.uint8
    assert torch.equal(out, codes)


@pytest.mark.parametrize("levels", LEVELS)
def test_all_max_codes_round_trip(levels):
    codes = torch.full((4, 40), levels - 1, dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, levels), levels, 40), codes)


@pytest.mark.parametrize(
    ("levels", "n", "nbytes"),
    [
        (5, 9, 3),
        (3, 5, 1),
        (3, 6, 2),
        (8, 8, 3),
        (8, 9, 6),
        (4, 64, 16),
        (16, 3, 2),
        (2, 9, 2),
        (7, 3, 2),
        (17, 3, 3),
        (256, 5, 5),
        (32, 1, 5),
        (64, 5, 6),
        (64, 3, 3),
        (3, 0, 0),
    ],
)
def test_packed_length(levels, n, nbytes):
    assert packed_length(n, levels) == nbytes


def test_base5_hand_byte():
    assert pack(torch.tensor([1, 2, 3], dtype=torch.uint8), 5).tolist() == [1 + 2 * 5 + 3 * 25]


def test_base3_hand_bytes():
    # Five codes per byte; the sixth starts a new, zero-padded byte.
    codes = torch.tensor([2, 2, 2, 2, 2, 1], dtype=torch.uint8)
    assert pack(codes, 3).tolist() == [242, 1]


def test_two_bit_hand_byte():
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 4).tolist() == [1 | 2 << 2 | 3 << 4]


def test_three_bit_stream_hand_bytes():
    # LSB-first stream of 3-bit codes: code 2 (bits 6..8) straddles bytes 0 and 1.
    codes = torch.tensor([5, 0, 7, 1, 0, 0, 0, 6], dtype=torch.uint8)
    word = 5 | 0 << 3 | 7 << 6 | 1 << 9 | 6 << 21
    expected = [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    assert expected == [0xC5, 0x03, 0xC0]
    assert pack(codes, 8).tolist() == expected


def test_one_bit_hand_byte_and_padding():
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [0x81, 0x01]


def test_leading_dims_pack_independently():
    codes = torch.tensor([[1, 2, 3], [4, 0, 0]], dtype=torch.uint8)
    assert pack(codes, 5).tolist() == [[86], [4]]


@pytest.mark.parametrize(
    ("levels", "bits"),
    [
        (2, 1.0),
        (3, 1.6),
        (4, 2.0),
        (5, 8 / 3),
        (6, 8 / 3),
        (7, 4.0),
        (8, 3.0),
        (15, 4.0),
        (16, 4.0),
        (17, 8.0),
        (32, 5.0),
        (64, 6.0),
        (255, 8.0),
        (256, 8.0),
    ],
)
def test_packed_bits_per_code(levels, bits):
    assert packed_bits_per_code(levels) == pytest.approx(bits)


def test_chunk_layout_table():
    assert chunk_layout(3) == (5, 1)
    assert chunk_layout(8) == (8, 3)
    assert chunk_layout(64) == (4, 3)
    assert chunk_layout(128) == (8, 7)


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), 8, 9)


@pytest.mark.parametrize("levels", [1, 257, 0])
def test_bad_levels(levels):
    with pytest.raises(ValueError):
        packed_length(4, levels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("levels", [3, 4, 5, 8, 16, 256])
def test_cuda_matches_cpu(levels):
    codes = torch.randint(0, levels, (4, 77), dtype=torch.uint8)
    packed = pack(codes, levels)
    packed_cuda = pack(codes.cuda(), levels)
    assert torch.equal(packed_cuda.cpu(), packed)
    assert torch.equal(unpack(packed_cuda, levels, 77).cpu(), codes)
