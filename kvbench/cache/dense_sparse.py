"""Dense-and-sparse storage (KVQuant, Hooper et al., NeurIPS 2024, Secs. 3.3-3.4): codebook codes
of every element plus the outliers held exactly in a sparse structure.

Reconstruction: ``x_hat = c[q] * scale + zero`` (:mod:`kvbench.quant.nuq`) with outliers overwritten
by their fp16 values. Held (``held_tensors``): ``codes`` (packed codebook indices,
:mod:`kvbench.quant.packing`), ``scales``/``zeros`` (fp16: per token for online ranges, per
(head, channel) for fixed ones), ``sparse`` (int32 token index, int16 (or int32) index of
(batch, head, channel), fp16 value; entries ordered by token).

Every part lives in a doubling buffer (:class:`~kvbench.cache.growable.GrowableTokens`), so an
append costs O(new tokens); :meth:`DenseSparseTokens.source` reads the store block by block for
attention, outliers included (:class:`~kvbench.cache.codebook_source.CodebookSource`).

Appends run inside every decode step, so they avoid making the host wait for the device: the
codebook, its decision boundaries and fixed ranges are kept in float32 per device (built once, not
converted at every append), and per-token outliers, a fixed count per vector, are laid out from their
top-k indices (no mask read back). Threshold outliers (fixed ranges: keys) have two layouts
(``outlier_layout``):

- ``ragged``: every element beyond its channel's threshold, as many as the data say
  (:func:`~kvbench.quant.nuq.key_outliers`), so in torch their count must come to the host: one
  ``nonzero`` per append. On the CPU (backend ``auto``) the whole append is one compiled call
  (``dense_sparse_quantize_pack`` in ``kvbench/kernels/cpu/attention.cpp``, bit-identical to the
  torch path): the codes, the ranges and the outlier entries come out together and nothing is read
  back.
- ``fixed``: ``k = outlier_count(D, f)`` per vector, those beyond their threshold by the most
  (:func:`~kvbench.quant.nuq.key_outliers_fixed`), laid out from their indices as the per-token
  outliers are: no host sync. Elements beyond the threshold that do not fit are coded like any
  other, clamped to the range, and counted on the device (:meth:`DenseSparseTokens.overflow`).
- ``auto`` (default): ``fixed`` with backend ``triton``, ``ragged`` otherwise (on the CPU the
  compiled call, or torch's ``nonzero``, which waits for nothing there), resolved at the first
  append. Not by device: backend ``auto`` shares its run ids across devices (reads that differ by
  float rounding only), and the two layouts store different values, so a CUDA run under ``auto``
  keeps the paper's ragged outliers (and their ``nonzero``), while ``triton``, whose runs have ids
  of their own, holds the fixed layout.

Both layouts code every element alike (the codes do not depend on the outliers), and their entries
read through the same sources.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.growable import GrowableTokens
from kvbench.kernels.cpu import cpu_kernels
from kvbench.quant.nuq import (
    key_outliers,
    key_outliers_fixed,
    masked_range,
    midpoints,
    nearest_code,
    normalize,
    outlier_count,
    scale_zero,
    topk_outlier_mask,
    topk_outliers,
)
from kvbench.quant.packing import chunk_layout, pack, unpack

OUTLIER_LAYOUTS = ("auto", "ragged", "fixed")


class _Tables(NamedTuple):
    codebook: torch.Tensor  # float32 [L]
    midpoints: torch.Tensor  # float32 [L - 1]
    channel_range: tuple[torch.Tensor, torch.Tensor] | None  # float32 (scale, zero) [1, H, 1, D]


class DenseSparseTokens:
    """Codebook codes of ``[B, H_kv, T, D]`` plus sparse fp16 outliers. ``channel_range`` (fp16
    ``(scale, zero)`` of shape ``[H_kv, D]``) selects per-channel fixed ranges; ``None`` per-token
    online ranges. ``backend``: ``auto`` appends through the compiled CPU kernel where it built,
    ``torch`` (or ``triton``) always through the reference. ``outlier_layout``
    (:data:`OUTLIER_LAYOUTS`): how threshold outliers are held (see the module docstring); ``auto``
    is resolved at the first append, after which the attribute holds the layout that ran."""

    def __init__(
        self,
        levels: int,
        codebook: torch.Tensor,
        fraction: float,
        channel_range=None,
        backend: str = "auto",
        outlier_layout: str = "auto",
    ):
        if outlier_layout not in OUTLIER_LAYOUTS:
            raise ValueError(f"outlier_layout must be one of {OUTLIER_LAYOUTS}, got {outlier_layout!r}")
        self.levels, self.fraction, self.backend = levels, fraction, backend
        self.outlier_layout = outlier_layout
        # threshold outliers beyond the fixed layout's budget, summed on the device (never read per step)
        self._overflow: torch.Tensor | None = None
        self.codebook = codebook.half()  # what is held
        self.channel_range = channel_range
        self._codes = GrowableTokens(torch.uint8)
        self._scale = GrowableTokens()  # per-token ranges (values)
        self._zero = GrowableTokens()
        # sparse entries, one [1, 1, n, 1] buffer each, in token order
        self._rows = GrowableTokens(torch.int32)
        self._cols = GrowableTokens()
        self._vals = GrowableTokens(torch.float16)
        self.num_tokens = 0
        self.shape: tuple[int, int, int] = (0, 0, 0)  # B, H, D
        self._tables: dict[torch.device, _Tables] = {}

    def tables(self, device: torch.device) -> _Tables:
        """The float32 codebook, its boundaries and the fixed range on ``device``, built once."""
        if device not in self._tables:
            rng = None
            if self.channel_range is not None:
                rng = tuple(p.to(device).float()[None, :, None, :] for p in self.channel_range)
            codebook = self.codebook.float().to(device)
            self._tables[device] = _Tables(codebook, midpoints(codebook), rng)
        return self._tables[device]

    def append(self, x: torch.Tensor) -> None:
        if x.shape[-2] == 0:
            return
        x = x.float()
        b, h, t, d = x.shape
        self.shape = (b, h, d)
        tables = self.tables(x.device)
        self._resolve_layout(x.device)
        if self._compiled_append(x, tables):
            self.num_tokens += t
            return
        top = mask = None
        if tables.channel_range is not None:
            scale, zero = tables.channel_range
            if self.outlier_layout == "fixed":
                fixed = key_outliers_fixed(x, scale, zero, self.fraction)
                if fixed is not None:
                    top, overflow = fixed
                    self._count_overflow(overflow)
            else:
                mask = key_outliers(x, scale, zero, self.fraction)
        else:
            top = topk_outliers(x, self.fraction) if self.fraction > 0 else None
            mask = None if top is None else topk_outlier_mask(x, self.fraction, top)
            scale, zero = scale_zero(*masked_range(x, mask))
            self._scale.append(scale)
            self._zero.append(zero)
        codes = pack(nearest_code(normalize(x, scale, zero), None, tables.midpoints), self.levels)
        self._codes.append(codes)
        if top is not None:
            self._append_sparse(*self._topk_entries(x, top))
        elif mask is not None:
            # as many as the data say: the count has to come to the host (one sync); indexing by the
            # indices rather than by the mask reads it once
            ib, ih, it, id_ = mask.nonzero(as_tuple=True)
            vals = x[ib, ih, it, id_]
            order = torch.sort(it, stable=True).indices  # token order, so that reads find a range
            self._append_sparse(it[order], ((ib * h + ih) * d + id_)[order], vals[order])
        self.num_tokens += t

    def _resolve_layout(self, device: torch.device) -> None:
        if self.outlier_layout == "auto":
            self.outlier_layout = "fixed" if self.backend == "triton" else "ragged"

    def _count_overflow(self, overflow: torch.Tensor) -> None:
        """Adds the overflow ``[B, H, t]`` of an append to the device-side total."""
        if self._overflow is None:
            self._overflow = torch.zeros((), dtype=torch.int64, device=overflow.device)
        self._overflow += overflow.sum()

    def overflow(self) -> torch.Tensor | None:
        """int64 scalar on the store's device: the elements beyond their channel's threshold that the
        fixed layout had no slot for, over every append (coded and clamped like in-range ones); None
        where no fixed-layout append with outliers ran. Reading it is a host sync: once per request."""
        return self._overflow

    def _compiled_append(self, x: torch.Tensor, tables: _Tables) -> bool:
        """The append as one compiled call on the CPU; False where it does not run (another backend
        or device, no compiled kernels, or fixed-layout threshold outliers, which it does not lay out)."""
        if self.backend != "auto" or x.device.type != "cpu":
            return False
        if tables.channel_range is not None and self.outlier_layout == "fixed":
            return False
        module = cpu_kernels()
        if module is None:
            return False
        c, m = chunk_layout(self.levels)
        fixed = tables.channel_range
        k = 0 if fixed is not None else outlier_count(x.shape[-1], self.fraction)
        packed, scale, zero, rows, cols, vals = module.dense_sparse_quantize_pack(
            x, tables.midpoints, self.levels, c, m, k,
            None if fixed is None else fixed[0], None if fixed is None else fixed[1],
            fixed is not None and self.fraction > 0,
        )  # fmt: skip
        if fixed is None:
            self._scale.append(scale)
            self._zero.append(zero)
        self._codes.append(packed)
        if fixed is None and k or fixed is not None and self.fraction > 0:
            self._append_sparse(rows, cols, vals)
        return True

    @staticmethod
    def _topk_entries(x: torch.Tensor, top: torch.Tensor):
        """The entries of per-vector outliers at channels ``top [B, H, t, k]`` (ascending), in the
        order ``nonzero`` plus a stable sort by token gives: token, then batch, head, channel."""
        b, h, t, k = top.shape
        d = x.shape[-1]
        vals = x.gather(-1, top)
        cols = torch.arange(0, b * h * d, d, device=x.device).view(b, h, 1, 1) + top
        rows = torch.arange(t, device=x.device).view(1, 1, t, 1).expand(b, h, t, k)
        return tuple(y.permute(2, 0, 1, 3).reshape(-1) for y in (rows, cols, vals))

    def _append_sparse(self, rows, cols, vals) -> None:
        """Entries in token order: ``rows`` token index within the append, ``cols`` flat ``(b * H_kv
        + h) * D + d``, ``vals`` exact values (1-d each)."""
        b, h, d = self.shape
        col_dtype = torch.int16 if b * h * d <= torch.iinfo(torch.int16).max else torch.int32
        self._rows.append((rows + self.num_tokens).to(torch.int32).view(1, 1, -1, 1))
        self._cols.append(cols.to(col_dtype).view(1, 1, -1, 1))
        self._vals.append(vals.half().view(1, 1, -1, 1))

    @property
    def codes(self) -> torch.Tensor | None:
        return self._codes.view() if self.num_tokens else None

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale.view() if len(self._scale) else None

    @property
    def zero(self) -> torch.Tensor | None:
        return self._zero.view() if len(self._zero) else None

    def sparse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(rows, cols, vals)`` 1-d views in token order (rows: token index, cols: flat
        ``(b * H_kv + h) * D + d``), None without outliers."""
        if not len(self._rows):
            return None
        return tuple(buf.view().reshape(-1) for buf in (self._rows, self._cols, self._vals))

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero)`` broadcastable to ``[B, H_kv, T, D]`` (a fixed range in float32: the
        fp16 held values, exactly)."""
        if self.channel_range is not None:
            return self.tables(self._codes.buffer.device).channel_range
        return self.scale, self.zero

    def source(self) -> CodebookSource | None:
        """The store as a block source (None while empty)."""
        if not self.num_tokens:
            return None
        scale, zero = self._range()
        codebook = self.tables(self._codes.buffer.device).codebook
        return CodebookSource(
            self.codes, self.levels, self.shape[2], codebook, scale, zero, outliers=self.sparse()
        )

    def bytes_reserved(self) -> int:
        parts = (self._codes, self._scale, self._zero, self._rows, self._cols, self._vals)
        return sum(p.bytes_reserved() for p in parts)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``."""
        b, h, d = self.shape
        codes = unpack(self.codes, self.levels, d).long()
        if self.channel_range is not None:
            scale, zero = (p.float().to(codes.device)[None, :, None, :] for p in self.channel_range)
        else:
            scale, zero = self.scale.float(), self.zero.float()
        x = self.codebook.float().to(codes.device)[codes] * scale + zero
        sparse = self.sparse()
        if sparse is not None:
            rows, cols, vals = sparse
            rows, cols = rows.long(), cols.long()
            flat = ((cols // d) * self.num_tokens + rows) * d + cols % d
            x.view(-1)[flat] = vals.float()
        return x

    def __len__(self) -> int:
        return self.num_tokens

    def num_outliers(self) -> int:
        return len(self._vals)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not self.num_tokens:
            return {}
        sparse = self.sparse()
        held = {"codes": [self.codes], "sparse": [] if sparse is None else list(sparse)}
        if self.channel_range is not None:
            held["scales"], held["zeros"] = [self.channel_range[0]], [self.channel_range[1]]
        else:
            held["scales"], held["zeros"] = [self.scale], [self.zero]
        return held

    def quantized_values(self) -> int:
        b, h, d = self.shape
        return b * h * self.num_tokens * d

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)
