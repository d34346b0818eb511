"""Bit-plane (prefix-major) layout of B-bit codes, so that reading the top p bits moves p bits.

ReadKV (:mod:`kvbench.methods.readkv`) reads a prefix of every stored code's bits, and the prefix
length varies per key channel and per value token. With codes packed whole (a byte per 8-bit code)
a reader of p bits still moves every byte; here the codes of a store are cut into B *planes*, plane
``j`` holding bit ``B - 1 - j`` of every code (the most significant first), each plane packed 8
entries per byte (entry ``i`` of an octet in bit ``i``), so a prefix of p bits lives in planes
``0..p-1`` and the other planes are never touched. Two packings, one per allocation axis:

- ``along="token"`` (keys, whose prefix length is per channel): a byte holds one channel's bit of 8
  consecutive tokens. Planes ``uint8 [B, H_kv, T / 8, B_bits * D]``, row ``o`` (tokens
  ``8o..8o+7``), byte ``j * D + c``: reading plane ``j`` of channel ``c`` over T tokens moves
  ``T / 8`` bytes, exactly one bit per entry read.
- ``along="channel"`` (values, whose prefix length is per token): a byte holds 8 consecutive
  channels' bits of one token. Planes ``uint8 [B, H_kv, T, B_bits * ceil(D / 8)]``, byte
  ``j * ceil(D / 8) + k`` holds channels ``8k..8k+7`` (padded with 0 past D).

Stored bytes equal the packed B-bit codes' (B bits per entry) when T (keys) and D (values) are
multiples of 8. :func:`pack_planes` and :func:`unpack_planes` are exact inverses; :func:`plane_bits`
reads one plane.
"""

from __future__ import annotations

import torch

ALONG = ("token", "channel")

_BIT_TABLES: dict[str, torch.Tensor] = {}


def _bit_table(device: torch.device | str) -> torch.Tensor:
    """uint8 ``[256, 8]``: bit ``i`` of every byte value. Cached per device."""
    key = str(device)
    if key not in _BIT_TABLES:
        byte = torch.arange(256, dtype=torch.int64, device=device)[:, None]
        _BIT_TABLES[key] = ((byte >> torch.arange(8, device=device)) & 1).to(torch.uint8)
    return _BIT_TABLES[key]


def _check(bits: int, along: str) -> None:
    if along not in ALONG:
        raise ValueError(f"along must be one of {ALONG}, got {along!r}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack_planes(codes: torch.Tensor, bits: int, along: str) -> torch.Tensor:
    """Bit planes of B-bit codes ``[B, H_kv, T, D]`` (uint8, values < 2**bits), layout above.
    ``along="token"`` needs T a multiple of 8."""
    _check(bits, along)
    b, h, t, d = codes.shape
    shifts = torch.arange(bits - 1, -1, -1, device=codes.device)  # plane j: bit B - 1 - j
    planes = (codes.long()[..., None] >> shifts) & 1  # [B, H, T, D, bits]
    weights = 1 << torch.arange(8, device=codes.device)
    if along == "token":
        if t % 8:
            raise ValueError(f"token-packed planes need a multiple of 8 tokens, got {t}")
        octets = planes.reshape(b, h, t // 8, 8, d, bits)
        packed = (octets * weights[:, None, None]).sum(3)  # [B, H, T/8, D, bits]
        return packed.transpose(-1, -2).reshape(b, h, t // 8, bits * d).to(torch.uint8)
    d8 = -(-d // 8)
    if d8 * 8 != d:
        planes = torch.nn.functional.pad(planes, (0, 0, 0, d8 * 8 - d))
    octets = planes.reshape(b, h, t, d8, 8, bits)
    packed = (octets * weights[:, None]).sum(4)  # [B, H, T, D/8, bits]
    return packed.transpose(-1, -2).reshape(b, h, t, bits * d8).to(torch.uint8)


def plane_bits(planes: torch.Tensor, bits: int, j: int, along: str, head_dim: int) -> torch.Tensor:
    """Plane ``j`` (bit ``B - 1 - j`` of every code) as uint8 0/1 ``[B, H_kv, T, D]``; only that
    plane's bytes are read."""
    _check(bits, along)
    table = _bit_table(planes.device)
    b, h, rows, _ = planes.shape
    if along == "token":
        own = planes[..., j * head_dim : (j + 1) * head_dim]  # [B, H, T/8, D]
        out = table[own.long()]  # [B, H, T/8, D, 8]
        return out.transpose(-1, -2).reshape(b, h, rows * 8, head_dim)
    d8 = -(-head_dim // 8)
    own = planes[..., j * d8 : (j + 1) * d8]  # [B, H, T, D/8]
    return table[own.long()].reshape(b, h, rows, d8 * 8)[..., :head_dim]


def unpack_planes(planes: torch.Tensor, bits: int, along: str, head_dim: int) -> torch.Tensor:
    """The codes ``[B, H_kv, T, D]`` (uint8) of all planes: the inverse of :func:`pack_planes`."""
    code = None
    for j in range(bits):
        bit = plane_bits(planes, bits, j, along, head_dim) << (bits - 1 - j)
        code = bit if code is None else code | bit
    return code
