"""What attention reads a layer's stored tokens through: the source protocol, and sources built of others.

A layer's stored keys and values are each a :class:`TokenSource`: a sequence of ``num_tokens``
vectors that can be read back for any token range ``[start, stop)`` as float32
``[B, H_kv, stop - start, D]``. Sources hold what the cache holds (full-precision tokens,
:class:`~kvbench.cache.fp.FullPrecisionSource`; packed affine codes with their scales and zeros,
:mod:`kvbench.cache.affine_source`; codebook indices, :mod:`kvbench.cache.codebook_source`) and
dequantize only the range asked for; :mod:`kvbench.cache.blockwise` attends them block by block.

Sources answer two block operations, ``scores(q, start, stop) = q k_t^T`` and
``mix(p, start, stop) = sum_t p_t v_t``, which default to a read followed by a matmul
(:class:`BlockSource`); a source may answer them without dequantizing its block.

The two sources here read other sources: :class:`RoPESource` rotates the keys of an inner source
to their positions (KVQuant's pre-RoPE keys), :class:`ConcatSource` lays parts one after the other
(sink | quantized body | residual).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from kvbench.kernels.part_reads import PartReads, RopeTable, register_reads
from kvbench.quant.rope import cos_sin, rotate


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


# -- what the kernels read of these parts (kvbench.kernels.part_reads) --------------------------------


def _rope_table(part: RoPESource) -> RopeTable | None:
    return None if part.table is None else RopeTable(part.table[0], part.table[1], part.first_position)


def _rope_scores(reader, part: RoPESource, query):
    """Pre-RoPE keys: the inner part's read, handed the layer's table (the kernel rotates every
    decoded row; a part whose read takes no table declines)."""
    rope = _rope_table(part)
    if rope is None:
        return reader.decline("pre-RoPE keys need the layer's cos/sin table")
    return reader.part_scores(part.inner, query, rope)


def _rope_mix(reader, part: RoPESource, weights):
    rope = _rope_table(part)
    if rope is None:
        return reader.decline("pre-RoPE keys need the layer's cos/sin table")
    return reader.part_mix(part.inner, weights, rope)


def _rope_covers(reader, part: RoPESource) -> bool:
    rope = _rope_table(part)
    return rope is not None and reader.covers(part.inner, rope)


_ROPE_READS = PartReads(_rope_scores, _rope_mix, _rope_covers)
for _backend in ("compiled", "triton"):
    register_reads(RoPESource, _backend, _ROPE_READS)
