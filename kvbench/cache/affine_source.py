"""Block sources of affine codes (KIVI's layout): what attention reads a
:class:`~kvbench.cache.quantized.QuantizedTokens` through.

Affine sources may fold their parameters into the small side instead of dequantizing the codes:

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
in the same pass (:mod:`kvbench.cache.packed_source`).

``torch.compile`` (inductor, CPU) of a hand-fused key block (shift out the codes, affine map,
logits) took about a minute to compile and ran within the noise of eager on this machine, so the
eager path is the only one kept (``scripts/bench_blockwise.py --compile-probe`` repeats the probe).

ReadKV's query-adaptive prefix reads depend on the query and on attention weights over all stored
tokens, so they are not a static source; its stores read in full are the affine sources here.
"""

from __future__ import annotations

import torch

from kvbench.cache.packed_source import _PackedSource
from kvbench.kernels.part_reads import PackedCodes, PartReads, register_reads


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


# -- what the kernels read of these parts (kvbench.kernels.part_reads) --------------------------------
# Both backends' readers answer these calls on plain tensors: the compiled CPU kernels fold the
# parameters as the sources above do, Triton reads the parameters' shapes.


def _packed(part: PerTokenAffineSource | PerChannelAffineSource) -> PackedCodes:
    return PackedCodes(part.codes, part.levels, part.head_dim, scale=part.scale, zero=part.zero)


_TOKEN_READS = PartReads(
    scores=lambda reader, part, query: reader.token_affine_scores(query, _packed(part)),
    mix=lambda reader, part, weights: reader.token_affine_mix(weights, _packed(part), part.group_size),
)
_CHANNEL_READS = PartReads(
    scores=lambda reader, part, query: reader.channel_affine_scores(query, _packed(part), part.group_size),
    mix=lambda reader, part, weights: reader.channel_affine_mix(weights, _packed(part), part.group_size),
)
for _backend in ("compiled", "triton"):
    register_reads(PerTokenAffineSource, _backend, _TOKEN_READS)
    register_reads(PerChannelAffineSource, _backend, _CHANNEL_READS)
