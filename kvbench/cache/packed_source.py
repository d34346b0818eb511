"""Reading packed codes back a token range at a time: the byte lookups and the base of the code sources.

Codes packed by :mod:`kvbench.quant.packing` are decoded through a table per byte (or per digit
group of a base-L word) into uint8, or straight into the float32 values a codebook gives them;
:class:`_PackedSource` holds the packed bytes and decodes the ranges its subclasses ask for (the
affine sources of :mod:`kvbench.cache.affine_source`, the codebook source of
:mod:`kvbench.cache.codebook_source`).
"""

from __future__ import annotations

import functools

import torch

from kvbench.cache.source import BlockSource
from kvbench.quant.packing import (
    chunk_layout,
    group_table,
    is_bit_packed,
    lookup_unpack,
    packed_length,
    unpack,
)

_LOOKUPS: dict[tuple, torch.Tensor] = {}


def byte_lookup(
    levels: int, table: torch.Tensor | None = None, device: torch.device | str | None = None
) -> torch.Tensor | None:
    """``[rows, k]``: the k codes of each digit-group value (a byte for one-byte chunks, a group of
    a base-L word otherwise; :func:`~kvbench.quant.packing.digit_groups`), as uint8 (``table``
    None), or mapped through ``table [L]`` as float32. None for multi-byte power-of-two chunks
    (L = 8, 32, 64, 128), which are unpacked with shifts, and for a ``table`` over multi-byte
    base-L chunks (up to 64K rows, too many to map afresh for every source: those codes are
    unpacked and then looked up). (uint8 codes are four times fewer bytes to write than float32
    ones, and the affine map that follows promotes them in the same pass.)"""
    _, m = chunk_layout(levels)
    if m != 1 and (table is not None or is_bit_packed(levels)):
        return None
    device = torch.device(device) if device is not None else table.device if table is not None else "cpu"
    codes = group_table(levels, device)
    return codes if table is None else table.to(device).float()[codes.long()]


def _float_codes_lookup(levels: int, device: torch.device) -> torch.Tensor | None:
    """:func:`byte_lookup` of the codes themselves as float32, cached per (levels, device)."""
    key = (levels, str(device), "float")
    if key not in _LOOKUPS:
        lookup = byte_lookup(levels, device=device)
        _LOOKUPS[key] = None if lookup is None else lookup.to(device=device, dtype=torch.float32)
    return _LOOKUPS[key]


def decode_codes(
    packed: torch.Tensor,
    levels: int,
    head_dim: int,
    lookup: torch.Tensor | None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The codes of packed ``[..., M]`` bytes as uint8 ``[..., head_dim]``, or ``table[code]`` as float32."""
    if lookup is not None:
        return lookup_unpack(packed, levels, head_dim, lookup)
    codes = unpack(packed, levels, head_dim)
    return codes if table is None else table.float()[codes.long()]


def _check_packed(codes: torch.Tensor, levels: int, head_dim: int) -> None:
    if codes.dtype != torch.uint8 or codes.dim() != 4:
        raise ValueError(f"codes must be uint8 [B, H_kv, T, M], got {codes.dtype} {tuple(codes.shape)}")
    if codes.shape[-1] != packed_length(head_dim, levels):
        raise ValueError(
            f"codes hold {codes.shape[-1]} bytes per token; head_dim={head_dim} at levels={levels} takes "
            f"{packed_length(head_dim, levels)}"
        )


class _PackedSource(BlockSource):
    def __init__(self, codes: torch.Tensor, levels: int, head_dim: int, table: torch.Tensor | None = None):
        _check_packed(codes, levels, head_dim)
        self.codes, self.levels, self.head_dim = codes, levels, head_dim
        self.table = table

    # Built on first use: a source is made every decode step, and the compiled kernels, which
    # read the bytes themselves, never need these tables.
    @functools.cached_property
    def lookup(self) -> torch.Tensor | None:
        return byte_lookup(self.levels, self.table, self.codes.device)

    @functools.cached_property
    def float_lookup(self) -> torch.Tensor | None:
        """The code values as float32 (for the folded paths, which feed codes straight to a matmul)."""
        if self.table is not None:
            return self.lookup
        return _float_codes_lookup(self.levels, self.codes.device)

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]

    @property
    def num_heads(self) -> int:
        return self.codes.shape[1]

    def _codes(self, start: int, stop: int) -> torch.Tensor:
        """``[B, H_kv, stop - start, D]``: the codes of the range (uint8), or their table values
        (float32) for a codebook source."""
        return decode_codes(
            self.codes[..., start:stop, :], self.levels, self.head_dim, self.lookup, self.table
        )

    def _float_codes(self, start: int, stop: int) -> torch.Tensor:
        """float32 ``[B, H_kv, stop - start, D]``: the code values of the range, in one pass."""
        packed = self.codes[..., start:stop, :]
        if self.float_lookup is None:
            return unpack(packed, self.levels, self.head_dim).float()
        return decode_codes(packed, self.levels, self.head_dim, self.float_lookup)
