"""Tests for kvbench.quant.packing: round trips, byte counts and hand-computed bytes."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.quant.packing import (
    MAX_WORD_BYTES,
    chunk_layout,
    digit_groups,
    group_table,
    lookup_unpack,
    pack,
    packed_bits_per_code,
    packed_length,
    unpack,
)

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
        (7, 3, 4),
        (7, 12, 8),
        (5, 10, 3),
        (5, 11, 6),
        (9, 6, 4),
        (17, 3, 4),
        (100, 3, 3),
        (256, 5, 5),
        (32, 1, 5),
        (64, 5, 6),
        (64, 3, 3),
        (3, 0, 0),
    ],
)
def test_packed_length(levels, n, nbytes):
    assert packed_length(n, levels) == nbytes


def test_base5_hand_bytes():
    # Ten base-5 digits in a 3-byte little-endian word; three codes leave the high digits 0.
    assert pack(torch.tensor([1, 2, 3], dtype=torch.uint8), 5).tolist() == [1 + 2 * 5 + 3 * 25, 0, 0]
    codes = [1, 2, 3, 4, 0, 1, 2, 3, 4, 2]
    word = sum(c * 5**i for i, c in enumerate(codes))
    assert word == 5738086
    assert pack(torch.tensor(codes, dtype=torch.uint8), 5).tolist() == [102, 142, 87]
    # the largest word, 5**10 - 1, uses the top byte
    assert pack(torch.full((10,), 4, dtype=torch.uint8), 5).tolist() == [0xF8, 0x02, 0x95]


def test_base7_hand_bytes():
    # 11 codes in a 32-bit word: 7**11 - 1 = 0x75DB9C96 (above 2**31, so no signed 32-bit word)
    assert pack(torch.full((11,), 6, dtype=torch.uint8), 7).tolist() == [0x96, 0x9C, 0xDB, 0x75]


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
    assert pack(codes, 5).tolist() == [[86, 0, 0], [4, 0, 0]]


@pytest.mark.parametrize(
    ("levels", "bits"),
    [
        (2, 1.0),
        (3, 1.6),
        (4, 2.0),
        (5, 2.4),
        (6, 8 / 3),
        (7, 32 / 11),
        (9, 3.2),
        (10, 24 / 7),
        (11, 32 / 9),
        (8, 3.0),
        (15, 4.0),
        (16, 4.0),
        (17, 32 / 7),
        (24, 4.8),
        (84, 6.4),
        (85, 8.0),
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
    assert chunk_layout(5) == (10, 3)
    assert chunk_layout(6) == (3, 1)
    assert chunk_layout(7) == (11, 4)
    assert chunk_layout(9) == (5, 2)
    assert chunk_layout(8) == (8, 3)
    assert chunk_layout(64) == (4, 3)
    assert chunk_layout(128) == (8, 7)


@pytest.mark.parametrize("levels", [x for x in range(3, 256) if x & (x - 1)])
def test_base_l_layout_is_the_tightest_word(levels):
    # Against every word of 1..4 bytes: the chunk fits (L**c <= 256**m), holds as many codes as fit,
    # and no other word size costs fewer bits per code (ties go to the fewer bytes).
    c, m = chunk_layout(levels)
    assert levels**c <= 256**m < levels ** (c + 1)
    for other in range(1, MAX_WORD_BYTES + 1):
        fit = max(k for k in range(0, 33) if levels**k <= 256**other)
        if fit:
            assert 8 * m / c <= 8 * other / fit + 1e-12, (levels, other, fit)
            if other < m:
                assert 8 * m / c < 8 * other / fit, (levels, other, fit)
    if levels <= 16:
        # the level counts methods use: within half a bit of the entropy bound
        assert packed_bits_per_code(levels) - math.log2(levels) < 0.5


@pytest.mark.parametrize("levels", [*range(3, 8), 9, 10, 11, 13, 17, 24, 40, 84, 85])
def test_lookup_unpack_maps_through_a_table(levels):
    # A float table gathered through the group table reads table[code] for every code.
    codes = torch.randint(0, levels, (2, 3, 70), dtype=torch.uint8)
    packed = pack(codes, levels)
    table = torch.randn(levels)
    groups = group_table(levels)
    g, k = digit_groups(levels)
    assert groups.shape[1] == k and groups.shape[0] <= 1 << 16
    assert g * k >= chunk_layout(levels)[0]
    out = lookup_unpack(packed, levels, 70, table[groups.long()])
    assert torch.equal(out, table[codes.long()])


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
