"""Growable storage of B-bit affine codes as bit planes (ReadKV's progressive store).

The codes, scales and zeros are :class:`~kvbench.cache.quantized.QuantizedTokens`' (same
:func:`~kvbench.quant.affine.quantize_grouped` call, so the same values), only the code bytes are
laid out as bit planes (:mod:`kvbench.quant.bitplanes`): keys (``axis="channel"``, per-channel
statistics over groups of G tokens, G a multiple of 8) in planes packed along tokens, values
(``axis="token"``) in planes packed along channels. Held, per store:

- ``codes``: the planes, ``uint8 [B, H_kv, T / 8, B * D]`` (keys) or ``[B, H_kv, T, B * ceil(D / 8)]``
  (values): B bits per entry, as the packed codes;
- ``scales``, ``zeros``: fp16, ``[B, H_kv, T / G, D]`` (keys) or ``[B, H_kv, T, D / G]`` (values).

Each lives in a doubling buffer (:class:`~kvbench.cache.growable.GrowableTokens`); views taken
before an append keep reading what they held.
"""

from __future__ import annotations

import math

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.cache.source import BlockSource
from kvbench.quant.affine import dequantize_grouped, quantize_grouped
from kvbench.quant.bitplanes import pack_planes, unpack_planes


class BitPlaneTokens:
    def __init__(self, bits: int, axis: str, group_size: int, param_dtype: torch.dtype = torch.float16):
        if axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
        if axis == "channel" and group_size % 8:
            raise ValueError(f"token-packed planes need group_size a multiple of 8, got {group_size}")
        self.bits, self.axis, self.group_size = bits, axis, group_size
        self.levels = 2**bits
        # keys' prefixes are per channel: planes along tokens; values' per token: along channels
        self.along = "token" if axis == "channel" else "channel"
        self.param_dtype = param_dtype
        rows = group_size if axis == "channel" else 1
        self._planes = GrowableTokens(torch.uint8, tokens_per_row=8 if self.along == "token" else 1)
        self._scale = GrowableTokens(param_dtype, tokens_per_row=rows)
        self._zero = GrowableTokens(param_dtype, tokens_per_row=rows)
        self.num_tokens = 0
        self.head_dim = 0

    def append(self, x: torch.Tensor) -> None:
        """Quantize and store ``x [B, H_kv, t, D]`` (t a multiple of G for keys)."""
        if x.shape[-2] == 0:
            return
        codes, scale, zero = quantize_grouped(
            x, self.levels, self.axis, self.group_size, param_dtype=self.param_dtype
        )
        self.head_dim = x.shape[-1]
        self._planes.append(pack_planes(codes, self.bits, self.along))
        self._scale.append(scale)
        self._zero.append(zero)
        self.num_tokens += x.shape[-2]

    @property
    def planes(self) -> torch.Tensor | None:
        return self._planes.view() if self.num_tokens else None

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale.view() if self.num_tokens else None

    @property
    def zero(self) -> torch.Tensor | None:
        return self._zero.view() if self.num_tokens else None

    def codes(self) -> torch.Tensor:
        """All B bits of every stored code, uint8 ``[B, H_kv, T, D]`` (reads every plane)."""
        return unpack_planes(self.planes, self.bits, self.along, self.head_dim)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``: the full B-bit reconstruction."""
        if not self.num_tokens:
            raise RuntimeError("empty BitPlaneTokens")
        return dequantize_grouped(self.codes(), self.scale, self.zero, self.axis, self.group_size)

    def source(self) -> PlaneSource | None:
        return PlaneSource(self) if self.num_tokens else None

    def bytes_reserved(self) -> int:
        return sum(b.bytes_reserved() for b in (self._planes, self._scale, self._zero))

    def __len__(self) -> int:
        return self.num_tokens

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not self.num_tokens:
            return {}
        return {"codes": [self.planes], "scales": [self.scale], "zeros": [self.zero]}

    def quantized_values(self) -> int:
        if not self.num_tokens:
            return 0
        planes = self.planes
        return planes.shape[0] * planes.shape[1] * self.num_tokens * self.head_dim

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)


class PlaneSource(BlockSource):
    """A :class:`BitPlaneTokens` read in full (all B planes) for the blockwise attention of
    prefill; decode reads only the planes of each prefix (:mod:`kvbench.methods.readkv`)."""

    def __init__(self, store: BitPlaneTokens):
        self.planes, self.scale, self.zero = store.planes, store.scale, store.zero
        self.bits, self.axis, self.along = store.bits, store.axis, store.along
        self.group, self.head_dim, self.tokens = store.group_size, store.head_dim, store.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.tokens

    @property
    def num_heads(self) -> int:
        return self.planes.shape[1]

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        g = self.group
        if self.axis == "channel":
            # whole key groups (and so whole token octets) around the range
            lo, hi = start // g * g, -(-stop // g) * g
            planes = self.planes[..., lo // 8 : hi // 8, :]
            codes = unpack_planes(planes, self.bits, self.along, self.head_dim)
            params = slice(lo // g, hi // g)
            x = dequantize_grouped(codes, self.scale[..., params, :], self.zero[..., params, :], "channel", g)
            return x[..., start - lo : stop - lo, :]
        codes = unpack_planes(self.planes[..., start:stop, :], self.bits, self.along, self.head_dim)
        return dequantize_grouped(
            codes, self.scale[..., start:stop, :], self.zero[..., start:stop, :], "token", g
        )
