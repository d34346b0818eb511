"""Packing of quantization codes into bytes, along the last axis.

Both schemes pack a *chunk* of ``c`` consecutive codes into ``m`` bytes through one integer word:

    word = sum_{i < c} code_i * L**i            (code 0 is the least significant digit)
    byte_j = (word >> (8 * j)) & 0xFF   for j < m   (little endian)

* ``L = 2**b`` (bit packing): ``L**i = 2**(b*i)``, so the word is an LSB-first bit stream in which
  code ``i`` occupies bits ``[b*i, b*(i+1))`` and stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``.
  A chunk is the smallest number of codes that fills whole bytes: ``c = lcm(b, 8) / b`` codes in
  ``m = lcm(b, 8) / 8`` bytes, i.e. ``8 / b`` codes in 1 byte for b = 1, 2, 4, 8; 8 codes in ``b``
  bytes for b = 3, 5, 7; 4 codes in 3 bytes for b = 6 (the same stream as 8 codes in 6 bytes, with
  finer padding). Codes never straddle a chunk boundary.
* Other ``L`` (base-L packing): ``c = k``, the largest ``k`` with ``L**k <= 256``, and ``m = 1``:
  ``byte = sum_i code_i * L**i`` (L = 3: 5 codes per byte; L = 5, 6: 3; L = 7..15: 2; L >= 17: 1).

For b = 1, 2, 4, 8 both descriptions give the same bytes. ``N`` codes take ``ceil(N / c)`` chunks;
the last chunk is padded with code 0, which the byte layout above makes zero bits/digits.
"""

from __future__ import annotations

import math

import torch

from kvbench.quant.levels import check_levels


def chunk_layout(levels: int) -> tuple[int, int]:
    """``(codes, bytes)`` of one chunk for a level count: ``(8, 3)`` for L = 8, ``(5, 1)`` for L = 3."""
    check_levels(levels)
    if levels & (levels - 1) == 0:
        bits = levels.bit_length() - 1
        span = math.lcm(bits, 8)
        return span // bits, span // 8
    k = 1
    while levels ** (k + 1) <= 256:
        k += 1
    return k, 1


def packed_length(n: int, levels: int) -> int:
    """Number of bytes holding ``n`` codes: ``ceil(n / c) * m`` for the chunk layout ``(c, m)``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    c, m = chunk_layout(levels)
    return -(-n // c) * m


def packed_bits_per_code(levels: int) -> float:
    """Storage cost of a code in a full chunk, ``8 * m / c``: 3.0 for L = 8, 1.6 for L = 3."""
    c, m = chunk_layout(levels)
    return 8 * m / c


def _digit_weights(levels: int, c: int, device: torch.device) -> torch.Tensor:
    """``L**i`` for ``i < c`` as int64 ``[c]``; at most ``2**56`` so it fits."""
    return torch.tensor([levels**i for i in range(c)], dtype=torch.int64, device=device)


_BYTE_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def _byte_table(levels: int, device: torch.device) -> torch.Tensor:
    """uint8 ``[256, c]``: the c codes held by each byte value (for layouts with one-byte chunks)."""
    key = (levels, str(device))
    if key not in _BYTE_TABLES:
        c, _ = chunk_layout(levels)
        byte = torch.arange(256, dtype=torch.int64, device=device)[:, None]
        _BYTE_TABLES[key] = (
            torch.div(byte, _digit_weights(levels, c, device), rounding_mode="floor") % levels
        ).to(torch.uint8)
    return _BYTE_TABLES[key]


def pack(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """Pack codes along the last axis (layout in the module docstring).

    Args:
        codes: ``[..., N]`` integer codes in ``[0, L - 1]`` (uint8). Out-of-range codes are not
            checked (that would need a device sync) and corrupt their neighbours.
        levels: level count ``L``.

    Returns:
        uint8 ``[..., packed_length(N, L)]``.
    """
    c, m = chunk_layout(levels)
    *lead, n = codes.shape
    chunks = -(-n // c)
    padded = codes.new_zeros(*lead, chunks * c, dtype=torch.int64)
    padded[..., :n] = codes
    digits = padded.reshape(*lead, chunks, c)
    weights = _digit_weights(levels, c, codes.device)
    # Sum of disjoint digits, so no carries: one word per chunk, < 256**m <= 2**56.
    word = (digits * weights).sum(dim=-1, keepdim=True)
    shifts = torch.arange(0, 8 * m, 8, dtype=torch.int64, device=codes.device)
    out = (word >> shifts) & 0xFF
    return out.reshape(*lead, chunks * m).to(torch.uint8)


def unpack(packed: torch.Tensor, levels: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`.

    Args:
        packed: uint8 ``[..., M]`` with ``M == packed_length(n, L)``.
        levels: level count ``L``.
        n: number of codes to return (drops the padding of the last chunk).

    Returns:
        uint8 codes ``[..., n]``.
    """
    c, m = chunk_layout(levels)
    *lead, size = packed.shape
    if size != packed_length(n, levels):
        raise ValueError(
            f"packed last axis has {size} bytes; {n} codes with levels={levels} take "
            f"{packed_length(n, levels)}"
        )
    if m == 1:
        # One chunk per byte (every L except 8, 32, 64, 128): a 256-row table lookup, several
        # times faster than the arithmetic below; it runs on every decode step.
        table = _byte_table(levels, packed.device)
        return table[packed.long()].reshape(*lead, size * c)[..., :n]
    chunks = size // m
    raw = packed.to(torch.int64).reshape(*lead, chunks, m)
    shifts = torch.arange(0, 8 * m, 8, dtype=torch.int64, device=packed.device)
    word = (raw << shifts).sum(dim=-1, keepdim=True)
    weights = _digit_weights(levels, c, packed.device)
    digits = torch.div(word, weights, rounding_mode="floor") % levels
    return digits.reshape(*lead, chunks * c)[..., :n].to(torch.uint8)
