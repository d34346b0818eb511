"""Attention of a query block over stored tokens, block by block, without materialising the cache.

A layer's stored keys and values are each a :class:`TokenSource`: a sequence of ``num_tokens``
vectors that can be read back for any token range ``[start, stop)`` as float32
``[B, H_kv, stop - start, D]``. Sources hold what the cache holds (full-precision tokens, packed
affine codes with their scales and zeros, codebook indices) and dequantize only the range asked
for. :func:`blockwise_attention` walks the stored tokens in blocks of ``block_size`` and merges the
blocks with an online softmax (running max ``m``, running sum ``l`` and a rescaled accumulator,
float32):

    m' = max(m, max_t s_t),   l' = l e^(m - m') + sum_t e^(s_t - m'),
    acc' = acc e^(m - m') + sum_t e^(s_t - m') v_t,       out = acc / l

so a decode step needs O(block) transient memory instead of O(cache). Read rule (the one
:mod:`kvbench.cache.layer` documents): stored tokens come from the sources and every query sees all
of them; the current forward's own tokens (``exact_keys``/``exact_values``, full precision) are
attended last, causally among themselves.

Sources answer two block operations, ``scores(q, start, stop) = q k_t^T`` and
``mix(p, start, stop) = sum_t p_t v_t``, which default to a read followed by a matmul. Affine
sources may fold their parameters into the small side instead of dequantizing the codes:

- per-channel keys (scale ``s_g``, zero ``z_g`` per channel for the group g of tokens holding t):
  ``q . k_t = (q * s_g) . c_t + q . z_g``;
- per-token values (scale ``s_t``, zero ``z_t`` per channel group of token t):
  ``sum_t p_t v_t = sum_t (p_t s_t) c_t + sum_t p_t z_t``.

Both are exact identities; in float32 they reassociate sums, so outputs differ from the
dequantize-then-matmul path by rounding only. Which path a source takes is chosen by ``fold``;
the defaults are the ones measured faster on CPU (``scripts/bench_blockwise.py``,
``benchmarks/bench_blockwise.md``): values fold (one small matmul per channel group on the float code
values, no affine pass over the block), keys do not (folding needs one tiny matmul per group of G
tokens, slower than one affine pass and one matmul). Affine codes are decoded through a table per
byte (or per digit group of a base-L word) into uint8 and the affine map promotes them to float32
in the same pass.

``torch.compile`` (inductor, CPU) of a hand-fused key block (shift out the codes, affine map,
logits) took about a minute to compile and ran within the noise of eager on this machine, so the
eager path is the only one kept (``scripts/bench_blockwise.py --compile-probe`` repeats the probe).

ReadKV's query-adaptive prefix reads depend on the query and on attention weights over all stored
tokens, so they are not a static source; its stores read in full are the affine sources here.

Codebook sources (KVQuant's nuq, TurboQuant's Lloyd-Max codes) look every byte up in a table that
turns it into the codebook values it holds; TurboQuant's codes live in a rotated space ``y = Pi x``,
and its source rotates the query once per block (``q . Pi^T y = (Pi q) . y``) and the value mix back
(``Pi^T sum_t p_t y_t``) instead of rotating every token.

Decode steps take the single-call path (:func:`single_call_attention`) instead of the block loop:
every stored part (a :class:`ConcatSource` is read part by part) answers ``scores`` over all its
tokens in one call, the logits of every part and of the exact tokens get one softmax, and every part
answers ``mix`` in one call, so the number of calls per layer does not grow with the context. It
runs when the logits of all stored tokens fit :data:`SINGLE_CALL_BUDGET` (a decode step's few query
rows), the block loop otherwise (prefill chunks over a long cache). The sources' own ``scores``/``mix``
over the whole part are the reference; a ``reader`` (:class:`PartReader`, the compiled CPU kernels of
:mod:`kvbench.kernels.cpu`) may answer a part instead, reading its bytes in place.

Masks: ``attention_mask`` may be transformers' boolean (True: attend) or additive float mask of shape
``[B or 1, 1 or H_q, q, T + q]`` over the stored tokens followed by the current ones; when given, it
replaces the built-in causal rule of the current tokens. Rows that see no token at all return 0.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvbench.env import env_positive_int
from kvbench.quant.packing import (
    chunk_layout,
    group_table,
    is_bit_packed,
    lookup_unpack,
    packed_length,
    unpack,
)
from kvbench.quant.rope import cos_sin, rotate

DEFAULT_BLOCK_SIZE = 1024
BLOCK_SIZE_ENV = "KVBENCH_BLOCK_SIZE"
# Most bytes of float32 logits the single-call path holds at once (all stored tokens x query rows x
# query heads); a decode step over 8K tokens of the default model needs 0.3 MB.
SINGLE_CALL_BUDGET = 4 << 20
# A decode step (at most DECODE_ROWS query positions: SpeCache's speculative step has two) always
# reads in single calls up to this much: its logits are a small fraction of the cache it reads
# (32K tokens of a Llama-3.1-8B layer: 4 MB of logits per query position against 64 MB of fp16 KV),
# and the block loop would make its calls grow with the context.
DECODE_ROWS = 2
DECODE_BUDGET = 256 << 20


@runtime_checkable
class TokenSource(Protocol):
    """Stored tokens ``[B, H_kv, T, D]`` read back a range at a time."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    def read(self, start: int, stop: int) -> torch.Tensor:
        """float32 ``[B, H_kv, stop - start, D]``."""

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``query [B, H_kv, M, D]`` (float32) times the keys of the range: ``[B, H_kv, M, stop - start]``."""

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``weights [B, H_kv, M, stop - start]`` (float32) times the values: ``[B, H_kv, M, D]``."""

    def boundaries(self) -> list[int]:
        """Token indices strictly inside ``(0, T)`` where the source changes storage; blocks are cut
        there so that no read straddles two parts."""


class BlockSource:
    """Defaults shared by the sources: block operations through :meth:`read`, no inner boundaries."""

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return torch.matmul(query, self.read(start, stop).transpose(-1, -2))

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return torch.matmul(weights, self.read(start, stop))

    def boundaries(self) -> list[int]:
        return []

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"range [{start}, {stop}) outside the {self.num_tokens} stored tokens")


# -- full precision ------------------------------------------------------------------------------
class FullPrecisionSource(BlockSource):
    """Tokens ``[B, H_kv, T, D]`` held in any float dtype, upcast to float32 one block at a time."""

    def __init__(self, data: torch.Tensor):
        if data.dim() != 4 or not data.is_floating_point():
            raise ValueError(
                f"data must be a float tensor [B, H_kv, T, D], got {data.dtype} {tuple(data.shape)}"
            )
        self.data = data

    @property
    def num_tokens(self) -> int:
        return self.data.shape[-2]

    @property
    def num_heads(self) -> int:
        return self.data.shape[1]

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        return self.data[..., start:stop, :].float()


# -- packed codes --------------------------------------------------------------------------------
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


class PerTokenAffineSource(_PackedSource):
    """Affine codes with per-token statistics over groups of G channels (KIVI's values):
    ``x[t, g*G + j] = c[t, g*G + j] * scale[t, g] + zero[t, g]``.

    Args:
        codes: uint8 ``[B, H_kv, T, packed_length(D, L)]``.
        scale, zero: ``[B, H_kv, T, D // G]`` (any float dtype).
        fold: compute ``mix`` as ``sum_t (p_t s_t) c_t + sum_t p_t z_t`` instead of dequantizing.
    """

    def __init__(self, codes, scale, zero, levels: int, group_size: int, head_dim: int, fold: bool = True):
        super().__init__(codes, levels, head_dim)
        b, h, t, _ = codes.shape
        if head_dim % group_size:
            raise ValueError(f"head_dim={head_dim} is not a multiple of group_size={group_size}")
        expected = (b, h, t, head_dim // group_size)
        for name, x in (("scale", scale), ("zero", zero)):
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected} (per-token groups)")
        self.scale, self.zero, self.group_size, self.fold = scale, zero, group_size, fold

    @classmethod
    def from_store(cls, store, fold: bool = True) -> PerTokenAffineSource:
        """The source of a ``QuantizedTokens`` with ``axis="token"`` (read, never modified)."""
        group = store.group_size or store.head_dim
        return cls(store.codes, store.scale, store.zero, store.levels, group, store.head_dim, fold)

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        c = self._codes(start, stop)
        b, h, n, d = c.shape
        s = self.scale[..., start:stop, :, None].float()
        z = self.zero[..., start:stop, :, None].float()
        return torch.addcmul(z, c.view(b, h, n, d // self.group_size, self.group_size), s).view(b, h, n, d)

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if not self.fold:
            return super().mix(weights, start, stop)
        self._check_range(start, stop)
        c = self._float_codes(start, stop)
        b, h, n, d = c.shape
        gs = self.group_size
        s = self.scale[..., start:stop, :].float()  # [B, H, n, D / G]
        z = self.zero[..., start:stop, :].float()
        # per channel group g: (p * s[:, g]) @ c[:, g's channels]; the zero term p @ z is constant
        # over the group's channels
        zero_term = torch.matmul(weights, z)  # [B, H, M, D / G]
        out = torch.empty(b, h, weights.shape[2], d, device=weights.device)
        for g in range(d // gs):
            torch.matmul(
                weights * s[..., None, :, g],
                c[..., g * gs : (g + 1) * gs],
                out=out[..., g * gs : (g + 1) * gs],
            )
        return out.view(b, h, -1, d // gs, gs).add_(zero_term[..., None]).view(b, h, -1, d)


class PerChannelAffineSource(_PackedSource):
    """Affine codes with per-channel statistics over groups of G consecutive tokens (KIVI's keys):
    ``x[t, d] = c[t, d] * scale[t // G, d] + zero[t // G, d]``. Ranges need not be group-aligned.

    Args:
        codes: uint8 ``[B, H_kv, T, packed_length(D, L)]``, T a multiple of G.
        scale, zero: ``[B, H_kv, T // G, D]``.
        fold: compute ``scores`` per group as ``(q * s_g) . c_t + q . z_g`` instead of dequantizing
            (on group-aligned ranges; unaligned ones are dequantized).
    """

    def __init__(self, codes, scale, zero, levels: int, group_size: int, head_dim: int, fold: bool = False):
        super().__init__(codes, levels, head_dim)
        b, h, t, _ = codes.shape
        if t % group_size:
            raise ValueError(
                f"per-channel codes hold T={t} tokens, not a multiple of group_size={group_size}"
            )
        expected = (b, h, t // group_size, head_dim)
        for name, x in (("scale", scale), ("zero", zero)):
            if tuple(x.shape) != expected:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}, expected {expected} (per-channel groups)"
                )
        self.scale, self.zero, self.group_size, self.fold = scale, zero, group_size, fold

    @classmethod
    def from_store(cls, store, fold: bool = False) -> PerChannelAffineSource:
        """The source of a ``QuantizedTokens`` with ``axis="channel"`` and a fixed group size."""
        if store.group_size is None:
            raise ValueError("a channel-axis store with group_size=None has no fixed group size")
        return cls(store.codes, store.scale, store.zero, store.levels, store.group_size, store.head_dim, fold)

    def _params(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero of every token of the range, ``[B, H_kv, stop - start, D]`` float32."""
        g = self.group_size
        first, last = start // g, -(-stop // g)
        offset = start - first * g
        s = (
            self.scale[..., first:last, :]
            .float()
            .repeat_interleave(g, dim=-2)[..., offset : offset + stop - start, :]
        )
        z = (
            self.zero[..., first:last, :]
            .float()
            .repeat_interleave(g, dim=-2)[..., offset : offset + stop - start, :]
        )
        return s, z

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        c = self._codes(start, stop)
        g = self.group_size
        if start % g == 0 and stop % g == 0:
            b, h, n, d = c.shape
            s = self.scale[..., start // g : stop // g, None, :].float()
            z = self.zero[..., start // g : stop // g, None, :].float()
            return torch.addcmul(z, c.view(b, h, n // g, g, d), s).view(b, h, n, d)
        s, z = self._params(start, stop)
        return torch.addcmul(z, c, s)

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        g = self.group_size
        if not self.fold or start % g or stop % g:
            return super().scores(query, start, stop)
        self._check_range(start, stop)
        c = self._float_codes(start, stop)
        b, h, n, d = c.shape
        s = self.scale[..., start // g : stop // g, :].float()  # [B, H, n/G, D]
        z = self.zero[..., start // g : stop // g, :].float()
        qs = query[:, :, None] * s[:, :, :, None, :]  # [B, H, n/G, M, D]
        logits = torch.matmul(qs, c.view(b, h, n // g, g, d).transpose(-1, -2))  # [B, H, n/G, M, G]
        logits = logits + torch.matmul(query, z.transpose(-1, -2)).transpose(-1, -2)[..., None]
        return logits.permute(0, 1, 3, 2, 4).reshape(b, h, query.shape[2], n)


class CodebookSource(_PackedSource):
    """Codebook indices: ``x = Pi^T (codebook[q] * scale + zero)`` with optional parts.

    Args:
        codes: uint8 ``[B, H_kv, T, packed_length(D, L)]`` of indices into ``codebook``.
        codebook: ``[L]`` values (any float dtype; KVQuant's nuq signposts, TurboQuant's Lloyd-Max
            centroids).
        scale, zero: None, or broadcastable to ``[B, H_kv, T, D]`` with a token axis of length T
            (per-token: KVQuant's value ranges ``[B, H_kv, T, 1]``, TurboQuant's norms) or 1 (fixed:
            KVQuant's calibrated per-channel key ranges ``[1, H_kv, 1, D]``).
        rotation: None, or ``[H_kv, D, D]``: the stored vectors are ``y = Pi x`` per head (TurboQuant);
            reads rotate back, ``scores``/``mix`` rotate the query and the mixed value instead.
        outliers: None, or ``(rows, cols, vals)`` (KVQuant's dense-and-sparse split): ``rows`` token
            index ascending, ``cols`` flat ``(b * H_kv + h) * D + d``, ``vals`` the exact values that
            overwrite the reconstruction. Blocks that hold an outlier take the read path.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        levels: int,
        head_dim: int,
        codebook: torch.Tensor,
        scale: torch.Tensor | None = None,
        zero: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
        outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        if codebook.dim() != 1 or codebook.shape[0] != levels:
            raise ValueError(f"codebook must be [levels={levels}], got {tuple(codebook.shape)}")
        super().__init__(codes, levels, head_dim, codebook.float())
        for name, x in (("scale", scale), ("zero", zero)):
            if x is not None and (x.dim() != 4 or x.shape[-2] not in (1, codes.shape[-2])):
                raise ValueError(
                    f"{name} must be 4-d with a token axis of 1 or T={codes.shape[-2]}, got {tuple(x.shape)}"
                )
        h = codes.shape[1]
        if rotation is not None and tuple(rotation.shape) != (h, head_dim, head_dim):
            raise ValueError(
                f"rotation must be [H_kv={h}, D, D] with D={head_dim}, got {tuple(rotation.shape)}"
            )
        self.scale, self.zero = scale, zero
        self.rotation = None if rotation is None else rotation.float()
        self.outliers = outliers

    def _param(self, x: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
        if x is None:
            return None
        return (x if x.shape[-2] == 1 else x[..., start:stop, :]).float()

    def _stored(self, start: int, stop: int) -> torch.Tensor:
        """float32 ``codebook[q] * scale + zero`` of the range, in the stored (rotated) space."""
        y = self._codes(start, stop)
        s, z = self._param(self.scale, start, stop), self._param(self.zero, start, stop)
        if s is not None:
            y = y * s
        if z is not None:
            y = y + z
        return y

    def _outliers_in(self, start: int, stop: int):
        if self.outliers is None:
            return None
        rows, cols, vals = self.outliers
        bounds = torch.tensor([start, stop], dtype=rows.dtype, device=rows.device)
        lo, hi = torch.searchsorted(rows, bounds).tolist()
        return None if lo == hi else (rows[lo:hi], cols[lo:hi], vals[lo:hi])

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        x = self._stored(start, stop)
        if self.rotation is not None:
            x = torch.matmul(x, self.rotation)  # x_d = sum_e y_e Pi[e, d]
        hits = self._outliers_in(start, stop)
        if hits is not None:
            rows, cols, vals = hits
            n, d = stop - start, self.head_dim
            cols = cols.long()
            flat = ((cols // d) * n + (rows.long() - start)) * d + cols % d
            x = x.contiguous()
            x.view(-1)[flat] = vals.float()
        return x

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.outliers is not None and self._outliers_in(start, stop) is not None:
            return super().scores(query, start, stop)
        self._check_range(start, stop)
        if self.rotation is not None:
            query = torch.matmul(query, self.rotation.transpose(-1, -2))  # (Pi q)_e = sum_d Pi[e, d] q_d
        return torch.matmul(query, self._stored(start, stop).transpose(-1, -2))

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if self.outliers is not None and self._outliers_in(start, stop) is not None:
            return super().mix(weights, start, stop)
        self._check_range(start, stop)
        out = torch.matmul(weights, self._stored(start, stop))
        return out if self.rotation is None else torch.matmul(out, self.rotation)


class RoPESource(BlockSource):
    """Keys stored before RoPE (KVQuant's pre-RoPE keys): reads rotate token ``i`` of ``inner`` to
    absolute position ``first_position + i`` (:mod:`kvbench.quant.rope`, default-type RoPE).
    ``table``: optional precomputed ``(cos, sin)`` ``[P, D]`` indexed by absolute position, covering
    every stored token (a layer keeps one grown by doubling instead of recomputing the angles of
    every block at every step)."""

    def __init__(
        self,
        inner: TokenSource,
        theta: float,
        first_position: int = 0,
        table: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.inner, self.theta, self.first_position = inner, theta, first_position
        if table is not None and table[0].shape[0] < first_position + inner.num_tokens:
            raise ValueError(
                f"the RoPE table covers {table[0].shape[0]} positions, the stored keys reach "
                f"{first_position + inner.num_tokens}"
            )
        self.table = table

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    @property
    def num_heads(self) -> int:
        return self.inner.num_heads

    def boundaries(self) -> list[int]:
        return self.inner.boundaries()

    def read(self, start: int, stop: int) -> torch.Tensor:
        x = self.inner.read(start, stop)
        lo, hi = self.first_position + start, self.first_position + stop
        if self.table is not None:
            cos, sin = self.table[0][lo:hi], self.table[1][lo:hi]
        else:
            cos, sin = cos_sin(torch.arange(lo, hi, device=x.device), x.shape[-1], self.theta)
        return rotate(x, cos, sin)


class ConcatSource(BlockSource):
    """Parts one after the other along tokens (sink | quantized body | residual); empty parts are
    dropped. Keys and values of one layer may be split differently: blocks are addressed by token
    index, so a key block and a value block cover the same tokens."""

    def __init__(self, parts: Sequence[TokenSource | None]):
        self.parts = [p for p in parts if p is not None and p.num_tokens > 0]
        self.offsets = [0]
        for p in self.parts:
            self.offsets.append(self.offsets[-1] + p.num_tokens)
        heads = {p.num_heads for p in self.parts}
        if len(heads) > 1:
            raise ValueError(f"parts disagree on the number of kv heads: {sorted(heads)}")
        self._heads = heads.pop() if heads else 0

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def num_heads(self) -> int:
        return self._heads

    def boundaries(self) -> list[int]:
        cuts = set(self.offsets[1:-1])
        for p, off in zip(self.parts, self.offsets, strict=False):
            cuts.update(off + c for c in p.boundaries())
        return sorted(cuts)

    def _pieces(self, start: int, stop: int):
        self._check_range(start, stop)
        for p, lo, hi in zip(self.parts, self.offsets[:-1], self.offsets[1:], strict=True):
            s, e = max(start, lo), min(stop, hi)
            if s < e:
                yield p, s - lo, e - lo, s - start, e - start

    def read(self, start: int, stop: int) -> torch.Tensor:
        pieces = [p.read(s, e) for p, s, e, _, _ in self._pieces(start, stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        pieces = [p.scores(query, s, e) for p, s, e, _, _ in self._pieces(start, stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        out = None
        for p, s, e, ws, we in self._pieces(start, stop):
            part = p.mix(weights[..., ws:we], s, e)
            out = part if out is None else out + part
        return out


# -- attention -----------------------------------------------------------------------------------
def block_ranges(num_tokens: int, block_size: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``block_size`` tokens covering ``[0, num_tokens)``, cut at
    every index in ``cuts`` (so no range straddles two parts of a source)."""
    edges = sorted({0, num_tokens, *(c for c in cuts if 0 < c < num_tokens)})
    ranges = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        ranges.extend((s, min(s + block_size, hi)) for s in range(lo, hi, block_size))
    return ranges


def _mask_rows(mask: torch.Tensor, heads: int, n_rep: int) -> torch.Tensor:
    """``[B', 1 or H_q, q, n]`` -> ``[B', 1 or H_kv, n_rep * q, n]`` in the query-row order used here."""
    b, h, q, n = mask.shape
    if h == 1:
        return mask[:, :, None].expand(b, 1, n_rep, q, n).reshape(b, 1, n_rep * q, n)
    return mask.reshape(b, heads, n_rep * q, n)


def _as_additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.float()


class _OnlineSoftmax:
    """Running ``(m, l, acc)`` over blocks of logits ``[B, H_kv, M, n]``, float32."""

    def __init__(self, shape: tuple[int, int, int], head_dim: int, device):
        b, h, m = shape
        self.m = torch.full((b, h, m, 1), -math.inf, device=device)
        self.l = torch.zeros(b, h, m, 1, device=device)
        self.acc = torch.zeros(b, h, m, head_dim, device=device)

    def weights(self, logits: torch.Tensor) -> torch.Tensor:
        """Fold the block's max into the state, rescale, and return its unnormalized weights."""
        m_new = torch.maximum(self.m, logits.amax(dim=-1, keepdim=True))
        # a row that has seen only -inf so far keeps reference 0, so exp() gives 0, not NaN
        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(logits - ref)
        alpha = torch.exp(self.m - ref)
        self.l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        self.acc.mul_(alpha)
        self.m = m_new
        return p

    def add(self, mixed: torch.Tensor) -> None:
        self.acc.add_(mixed)

    def result(self) -> torch.Tensor:
        return self.acc / torch.where(self.l > 0, self.l, torch.ones_like(self.l))


def _positional_mask(positions: torch.Tensor, mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Additive ``[B, H_kv, rows or 1, n]`` bias of stored tokens at ``positions [B, H_kv, n]``: -inf
    where the position is -1, else the mask's column at that position (0 without a mask)."""
    hidden = positions < 0
    if mask is None:
        zero = torch.zeros((), device=positions.device)
        return torch.where(hidden, -math.inf, zero)[:, :, None, :]
    b, h, n = positions.shape
    m = mask.expand(max(b, mask.shape[0]), h, rows, mask.shape[-1])
    cols = positions.clamp(min=0)[:, :, None, :].expand(m.shape[0], h, rows, n)
    return m.gather(-1, cols).masked_fill(hidden[:, :, None, :], -math.inf)


class LogitObserver:
    """Sees what :func:`blockwise_attention` computes, for methods that choose tokens by attention
    (SpeCache's top-k): :meth:`block` gets each block's scaled, masked logits ``[B, H_kv, rows, n]``
    (rows ordered ``(rep, position)``) for stored tokens ``[start, stop)`` and then for the exact
    tokens (``start`` = T); :meth:`done` the final running max ``m`` and sum ``l`` ``[B, H_kv, rows,
    1]``, so that a probability is ``exp(logit - m) / l``. The default does nothing."""

    def block(self, start: int, stop: int, logits: torch.Tensor) -> None:
        pass

    def done(self, m: torch.Tensor, l: torch.Tensor) -> None:  # noqa: E741
        pass


def _exact_logits(
    qf: torch.Tensor, exact_keys: torch.Tensor, mask: torch.Tensor | None, q: int
) -> torch.Tensor:
    """Logits ``[B, H_kv, rows, t]`` of the scaled query rows ``qf`` over this forward's own ``t``
    tokens: the mask's last ``t`` columns when given, else causal among the ``q`` queries (query i
    is exact token ``t - q + i``)."""
    logits = torch.matmul(qf, exact_keys.float().transpose(-1, -2))
    t = exact_keys.shape[-2]
    if mask is not None:
        return logits + mask[..., mask.shape[-1] - t :]
    if t > 1:
        own = torch.arange(qf.shape[-2], device=qf.device) % q + (t - q)
        hidden = torch.arange(t, device=qf.device)[None, :] > own[:, None]
        logits = logits.masked_fill(hidden, -math.inf)
    return logits


def blockwise_attention(
    query: torch.Tensor,
    keys: TokenSource | None,
    values: TokenSource | None,
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over stored tokens and the current forward's own tokens.

    Args:
        query: ``[B, H_q, q, D]``, ``H_q = H_kv * n_rep``; query head h reads kv head ``h // n_rep``
            (transformers' ``repeat_kv`` order).
        keys, values: sources of the T stored tokens (equal ``num_tokens``), or None when nothing is
            stored yet.
        scaling: logit scale (``D ** -0.5``).
        block_size: stored tokens per block (blocks are also cut where a source changes parts).
        exact_keys, exact_values: ``[B, H_kv, q, D]`` (any float dtype), the tokens of this forward,
            attended in full precision; query i sees exact tokens ``0..i``.
        attention_mask: optional ``[B or 1, 1 or H_q, q, T + q]`` boolean (True: attend) or additive
            float mask; replaces the causal rule of the exact tokens.
        positions: None when the stored tokens are held in sequence order (stored token i is
            position i). Else int64 ``[B, H_kv, T]``: the sequence position of each stored token per
            kv head (sources that hold a head's tokens out of order: outlier pools, two-level
            stores, prefetched rows), or -1 for a stored entry that is never attended (a quantized
            copy superseded by an exact one). The mask's stored columns are indexed by position.
        observer: optional :class:`LogitObserver`, shown every block's masked logits (stored
            blocks, then the exact tokens) and the final softmax state.

    Returns:
        ``[B, q, H_q, D]`` in ``query.dtype`` (the layout transformers' attention functions return).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if (keys is None) != (values is None) or (exact_keys is None) != (exact_values is None):
        raise ValueError("keys and values (and exact_keys and exact_values) must be given together")
    stored = 0 if keys is None else keys.num_tokens
    if keys is not None and values.num_tokens != stored:
        raise ValueError(f"keys hold {stored} tokens but values hold {values.num_tokens}")
    if stored == 0 and exact_keys is None:
        raise ValueError("nothing to attend: no stored tokens and no exact tokens")
    b, hq, q, d = query.shape
    hkv = exact_keys.shape[1] if exact_keys is not None else keys.num_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    n_rep = hq // hkv
    rows = n_rep * q
    qf = (query.float() * scaling).reshape(b, hkv, rows, d)  # rows ordered (rep, position)
    if attention_mask is not None:
        mask = _as_additive(_mask_rows(attention_mask, hkv, n_rep))
    if positions is not None:
        if tuple(positions.shape) != (b, hkv, stored):
            raise ValueError(
                f"positions must be [B, H_kv, T] = {(b, hkv, stored)}, got {tuple(positions.shape)}"
            )
        positions = positions.long()
    state = _OnlineSoftmax((b, hkv, rows), d, query.device)
    if stored:
        cuts = set(keys.boundaries()) | set(values.boundaries())
        for start, stop in block_ranges(stored, block_size, sorted(cuts)):
            logits = keys.scores(qf, start, stop)
            if positions is not None:
                logits = logits + _positional_mask(
                    positions[..., start:stop], mask if attention_mask is not None else None, rows
                )
            elif attention_mask is not None:
                logits = logits + mask[..., start:stop]
            if observer is not None:
                observer.block(start, stop, logits)
            p = state.weights(logits)
            state.add(values.mix(p, start, stop))
    if exact_keys is not None:
        logits = _exact_logits(qf, exact_keys, mask if attention_mask is not None else None, q)
        if observer is not None:
            observer.block(stored, stored + exact_keys.shape[-2], logits)
        p = state.weights(logits)
        state.add(torch.matmul(p, exact_values.float()))
    if observer is not None:
        observer.done(state.m, state.l)
    out = state.result().reshape(b, hq, q, d)
    return out.transpose(1, 2).contiguous().to(query.dtype)


class PartReader(Protocol):
    """Answers whole-part ``scores``/``mix`` for the parts it covers (compiled kernels), None for the
    others, which then run their torch reference."""

    def scores(self, part: TokenSource, query: torch.Tensor) -> torch.Tensor | None: ...

    def mix(self, part: TokenSource, weights: torch.Tensor) -> torch.Tensor | None: ...


def source_parts(source: TokenSource) -> list[TokenSource]:
    """The stored parts of a source in token order (a :class:`ConcatSource` flattened)."""
    if isinstance(source, ConcatSource):
        return [leaf for p in source.parts for leaf in source_parts(p)]
    return [source]


def part_scores(parts: list[TokenSource], query: torch.Tensor, reader: PartReader | None) -> torch.Tensor:
    """``[B, H_kv, M, T]``: the logits of every part, one call each, concatenated along tokens."""
    pieces = []
    for part in parts:
        out = reader.scores(part, query) if reader is not None else None
        pieces.append(out if out is not None else part.scores(query, 0, part.num_tokens))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def part_mix(parts: list[TokenSource], weights: torch.Tensor, reader: PartReader | None) -> torch.Tensor:
    """``[B, H_kv, M, D]``: ``weights [B, H_kv, M, T]`` times the values of every part, summed."""
    total, start = None, 0
    for part in parts:
        w = weights[..., start : start + part.num_tokens]
        start += part.num_tokens
        out = reader.mix(part, w) if reader is not None else None
        if out is None:
            out = part.mix(w, 0, part.num_tokens)
        total = out if total is None else total.add_(out)
    return total


def fits_single_call(query: torch.Tensor, num_kv_heads: int, stored: int) -> bool:
    """Whether the logits of ``query [B, H_q, q, D]`` over ``stored`` tokens fit the budget."""
    b, hq, q, _ = query.shape
    logits = b * hq * q * stored * 4
    return logits <= SINGLE_CALL_BUDGET or q <= DECODE_ROWS and logits <= DECODE_BUDGET


def single_call_attention(
    query: torch.Tensor,
    keys: TokenSource,
    values: TokenSource,
    scaling: float,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
    reader: PartReader | None = None,
) -> torch.Tensor:
    """:func:`blockwise_attention` (same arguments, same read rule, same result up to float
    reassociation) with one ``scores`` and one ``mix`` call per stored part and one softmax over
    all logits, stored and exact; ``reader`` may answer parts with compiled kernels. The observer
    sees the stored logits as one block ``[0, T)``, then the exact ones."""
    stored = keys.num_tokens
    if values.num_tokens != stored:
        raise ValueError(f"keys hold {stored} tokens but values hold {values.num_tokens}")
    if (exact_keys is None) != (exact_values is None):
        raise ValueError("exact_keys and exact_values must be given together")
    b, hq, q, d = query.shape
    hkv = keys.num_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    n_rep = hq // hkv
    rows = n_rep * q
    qf = (query.float() * scaling).reshape(b, hkv, rows, d)  # rows ordered (rep, position)
    mask = _as_additive(_mask_rows(attention_mask, hkv, n_rep)) if attention_mask is not None else None
    if positions is not None:
        if tuple(positions.shape) != (b, hkv, stored):
            raise ValueError(
                f"positions must be [B, H_kv, T] = {(b, hkv, stored)}, got {tuple(positions.shape)}"
            )
    key_parts, value_parts = source_parts(keys), source_parts(values)
    logits = part_scores(key_parts, qf, reader)
    if positions is not None:
        logits = logits + _positional_mask(positions.long(), mask, rows)
    elif mask is not None:
        logits = logits + mask[..., :stored]
    if observer is not None:
        observer.block(0, stored, logits)
    every = [logits]
    if exact_keys is not None:
        exact = _exact_logits(qf, exact_keys, mask, q)
        if observer is not None:
            observer.block(stored, stored + exact_keys.shape[-2], exact)
        every.append(exact)
    every = every[0] if len(every) == 1 else torch.cat(every, dim=-1)
    m = every.amax(dim=-1, keepdim=True)
    # a row that sees no token keeps reference 0, so exp() gives 0, not NaN
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(every - ref)
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    if observer is not None:
        observer.done(m, l)
    out = part_mix(value_parts, p[..., :stored], reader)
    if exact_keys is not None:
        out = out.add_(torch.matmul(p[..., stored:], exact_values.float()))
    out = out / torch.where(l > 0, l, torch.ones_like(l))
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous().to(query.dtype)


def configured_block_size() -> int:
    """Stored tokens per attention block: ``KVBENCH_BLOCK_SIZE`` from the environment, else 1024.
    A ConfigError naming the variable when it is not a positive integer; a run checks it up front
    (:func:`kvbench.run.check_environment`)."""
    return env_positive_int(BLOCK_SIZE_ENV, DEFAULT_BLOCK_SIZE, "stored tokens per attention block")


def blockwise_attention_forward(
    module,
    query: torch.Tensor,
    keys: TokenSource | None,
    values: TokenSource | None,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    block_size: int | None = None,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
    reader: PartReader | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """:func:`blockwise_attention` in the shape of transformers' attention functions: returns
    ``(attn_output [B, q, H_q, D], None)`` so that a layer's ``attend`` can return it directly.
    ``block_size`` defaults to ``KVBENCH_BLOCK_SIZE`` from the environment, else 1024. When the
    logits of all stored tokens fit :data:`SINGLE_CALL_BUDGET` (decode steps) and no block size is
    asked for (neither the argument nor ``KVBENCH_BLOCK_SIZE``), :func:`single_call_attention`
    runs instead, with ``reader``'s kernels."""
    if scaling is None:
        scaling = module.scaling
    if (
        block_size is None
        and not os.environ.get(BLOCK_SIZE_ENV)
        and keys is not None
        and keys.num_tokens
        and fits_single_call(query, keys.num_heads, keys.num_tokens)
    ):
        out = single_call_attention(
            query,
            keys,
            values,
            scaling,
            exact_keys,
            exact_values,
            attention_mask,
            positions,
            observer,
            reader,
        )
        return out, None
    if block_size is None:
        block_size = configured_block_size()
    out = blockwise_attention(
        query,
        keys,
        values,
        scaling,
        block_size,
        exact_keys,
        exact_values,
        attention_mask,
        positions,
        observer,
    )
    return out, None
