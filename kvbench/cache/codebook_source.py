"""The block source of codebook indices: what attention reads a dense-and-sparse store
(:class:`~kvbench.cache.dense_sparse.DenseSparseTokens`) or rotated codes
(:class:`~kvbench.cache.rotated.RotatedCodes`) through.

Codebook sources (KVQuant's nuq, TurboQuant's Lloyd-Max codes) look every byte up in a table that
turns it into the codebook values it holds; TurboQuant's codes live in a rotated space ``y = Pi x``,
and its source rotates the query once per block (``q . Pi^T y = (Pi q) . y``) and the value mix back
(``Pi^T sum_t p_t y_t``) instead of rotating every token.
"""

from __future__ import annotations

import torch

from kvbench.cache.packed_source import _PackedSource
from kvbench.kernels.part_reads import PackedCodes, PartReads, register_reads


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


# -- what the kernels read of this part (kvbench.kernels.part_reads) ----------------------------------
# A rotation is applied around the kernel (the query before the scores, the mixed value after); the
# outliers are corrected after it; pre-RoPE keys (a RoPESource around this part) hand their table
# down, and the kernel rotates every decoded row to its position.


def _packed(part: CodebookSource) -> PackedCodes:
    p = part
    return PackedCodes(p.codes, p.levels, p.head_dim, p.table, p.scale, p.zero, p.outliers)


def _scores(reader, part: CodebookSource, query, rope):
    return reader.codebook_scores(query, _packed(part), part.rotation, rope)


def _mix(reader, part: CodebookSource, weights, rope):
    return reader.codebook_mix(weights, _packed(part), part.rotation, rope)


register_reads(CodebookSource, "compiled", PartReads(_scores, _mix, rope=True))
register_reads(
    CodebookSource,
    "triton",
    PartReads(
        _scores,
        _mix,
        covers=lambda reader, part, rope: reader.codebook_covers(_packed(part), part.rotation, rope),
        rope=True,
    ),
)
