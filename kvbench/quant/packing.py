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
* Other ``L`` (base-L packing): the word is a base-L number of ``c`` digits in a word of ``m <= 4``
  bytes (32 bits at most, which keeps the kernels' words in one register), with ``c`` the largest
  count that fits, ``L**c <= 256**m``, and ``m`` the one with the fewest bits per code ``8 m / c``
  (ties to the smallest ``m``). So a code costs close to ``log2 L`` bits: L = 3: 5 codes in 1 byte
  (1.6 bits, log2 3 = 1.58); L = 5: 10 in 3 bytes (2.4, against 2.32); L = 6: 3 in 1 (2.67);
  L = 7: 11 in 4 (2.91); L = 9: 5 in 2 (3.2); L = 10: 7 in 3; L = 11: 9 in 4; L = 12..15: 2 in 1
  (4.0); L = 17..23: 7 in 4; L >= 85: 1 in 1.

For b = 1, 2, 4, 8 both descriptions give the same bytes. ``N`` codes take ``ceil(N / c)`` chunks;
the last chunk is padded with code 0, which the byte layout above makes zero bits/digits.

Reading base-L words back goes through *digit groups*: the word is cut into groups of ``k``
digits by dividing by ``L**k``, and each group value is looked up in a table of its ``k`` codes.
:func:`unpack` (the torch reference's decode) uses groups of up to 64K values (:func:`digit_groups`:
L = 5 reads 2 groups of 5 digits per 3-byte word), the compiled kernels of
:mod:`kvbench.kernels.cpu` 256-value groups of float32 values (``L**k <= 256``, the digits of one
byte in the one-byte layouts). For one-byte chunks the group is the byte itself.
"""

from __future__ import annotations

import math

import torch

from kvbench.quant.levels import check_levels

# Longest base-L word, in bytes (a 32-bit word).
MAX_WORD_BYTES = 4
# 2: base-L codes in words of up to 4 bytes (1: one byte per chunk, e.g. 3 codes of 5 levels). Bit
# packing (powers of two) is the same in both; the run id of a config that packs another level
# count carries this (kvbench.results.canonical_config), so its old runs are not resumed as new.
PACKING_VERSION = 2


def chunk_layout(levels: int) -> tuple[int, int]:
    """``(codes, bytes)`` of one chunk for a level count: ``(8, 3)`` for L = 8, ``(10, 3)`` for L = 5."""
    check_levels(levels)
    return _CHUNKS[levels]


def _chunk_layout(levels: int) -> tuple[int, int]:
    if levels & (levels - 1) == 0:
        bits = levels.bit_length() - 1
        span = math.lcm(bits, 8)
        return span // bits, span // 8
    best = (0, 1)
    for m in range(1, MAX_WORD_BYTES + 1):
        c = 0
        while levels ** (c + 1) <= 256**m:
            c += 1
        # strictly fewer bits per code (8 m / c) than the best so far: ties keep the smaller m
        if c * best[1] > best[0] * m:
            best = (c, m)
    return best


# Most rows of a digit-group table of the torch reader (uint8 rows of k codes: 64K rows is at most
# 320 KB, against a 2-3x slower unpack with 256-row groups).
MAX_GROUP_ROWS = 1 << 16


def digit_groups(levels: int, max_rows: int = MAX_GROUP_ROWS) -> tuple[int, int]:
    """``(g, k)``: a chunk is read as ``g`` groups of ``k`` base-L digits, ``L**k <= max_rows``
    (as few groups as possible, then the smallest ``k``): ``(2, 5)`` for L = 5. One-byte chunks are
    one group, the byte. Not for multi-byte power-of-two chunks (L = 8, 32, 64, 128)."""
    c, m = chunk_layout(levels)
    if m == 1:
        return 1, c
    if is_bit_packed(levels):
        raise ValueError(f"levels={levels} packs bit streams, not base-L words")
    kmax = 1
    while levels ** (kmax + 1) <= max_rows:
        kmax += 1
    g = -(-c // kmax)
    return g, -(-c // g)


_CHUNKS = {levels: _chunk_layout(levels) for levels in range(2, 257)}


def is_bit_packed(levels: int) -> bool:
    """Whether ``L`` is a power of two, whose chunks are read with shifts rather than divisions."""
    return levels & (levels - 1) == 0


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


_WEIGHTS: dict[tuple[int, int, str], torch.Tensor] = {}


def _digit_weights(levels: int, c: int, device: torch.device | str) -> torch.Tensor:
    """``L**i`` for ``i < c`` as int64 ``[c]``; at most ``2**56`` so it fits. Cached per device, so
    a decode step copies no list to the device."""
    key = (levels, c, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.tensor([levels**i for i in range(c)], dtype=torch.int64, device=device)
    return _WEIGHTS[key]


_GROUP_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def group_table(levels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 ``[rows, k]``: the ``k`` codes of each group value (:func:`digit_groups`), digit 0
    first; ``rows = L**k``, or 256 for one-byte chunks, whose group value is the byte. Cached per
    (levels, device): built once, outside a decode step."""
    key = (levels, str(device))
    if key not in _GROUP_TABLES:
        _, k = digit_groups(levels)
        rows = 256 if chunk_layout(levels)[1] == 1 else levels**k
        value = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
        _GROUP_TABLES[key] = (
            torch.div(value, _digit_weights(levels, k, value.device), rounding_mode="floor") % levels
        ).to(torch.uint8)
    return _GROUP_TABLES[key]


def group_values(packed: torch.Tensor, levels: int) -> torch.Tensor:
    """The digit groups of every chunk, int64 ``[..., chunks, g]`` (:func:`digit_groups`).

    Group ``j`` holds digits ``[j k, (j + 1) k)`` of the chunk's word (the last one zero past digit
    ``c``); for one-byte chunks the value is the byte.
    """
    c, m = chunk_layout(levels)
    g, k = digit_groups(levels)
    *lead, size = packed.shape
    if m == 1:
        return packed.long().reshape(*lead, size, 1)
    raw = packed.reshape(*lead, size // m, m)
    word = raw[..., 0].long()
    for j in range(1, m):
        word |= raw[..., j].long() << (8 * j)
    base = levels**k
    groups = []
    for _ in range(g - 1):
        high = torch.div(word, base, rounding_mode="floor")
        groups.append(word - high * base)
        word = high
    groups.append(word)
    return torch.stack(groups, dim=-1)


def lookup_unpack(packed: torch.Tensor, levels: int, n: int, lookup: torch.Tensor) -> torch.Tensor:
    """``lookup[group]`` of every digit group: ``[..., n, *rest]`` from packed ``[..., M]``.

    ``lookup`` is ``[rows, k, *rest]`` (:func:`group_table`, or table values gathered through it);
    one gather per group, the padding digits of every chunk dropped.
    """
    c, _ = chunk_layout(levels)
    _, k = digit_groups(levels)
    groups = group_values(packed, levels)
    *lead, chunks, g = groups.shape
    rest = lookup.shape[2:]
    flat = torch.index_select(lookup, 0, groups.reshape(-1))
    if g * k != c:
        flat = flat.reshape(math.prod(lead), chunks, g * k, *rest)[:, :, :c]
    return flat.reshape(*lead, chunks * c, *rest).narrow(len(lead), 0, n)


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
    if m == 1 or not is_bit_packed(levels):
        # a 256-row table per digit group (one byte, or a group split off a base-L word): several
        # times faster than dividing out every digit; it runs on every decode step
        return lookup_unpack(packed, levels, n, group_table(levels, packed.device))
    chunks = size // m
    raw = packed.to(torch.int64).reshape(*lead, chunks, m)
    shifts = torch.arange(0, 8 * m, 8, dtype=torch.int64, device=packed.device)
    word = (raw << shifts).sum(dim=-1, keepdim=True)
    weights = _digit_weights(levels, c, packed.device)
    digits = torch.div(word, weights, rounding_mode="floor") % levels
    return digits.reshape(*lead, chunks * c)[..., :n].to(torch.uint8)
