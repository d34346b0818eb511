"""Dense-and-sparse storage (KVQuant, Hooper et al., NeurIPS 2024, Secs. 3.3-3.4): codebook codes
of every element plus the outliers held exactly in a sparse structure.

Reconstruction: ``x_hat = c[q] * scale + zero`` (:mod:`kvbench.quant.nuq`) with outliers overwritten
by their fp16 values. Held (``held_tensors``): ``codes`` (packed codebook indices,
:mod:`kvbench.quant.packing`), ``scales``/``zeros`` (fp16: per token for online ranges, per
(head, channel) for fixed ones), ``sparse`` (int32 token index, int16 (or int32) index of
(batch, head, channel), fp16 value).
"""

from __future__ import annotations

import math

import torch

from kvbench.quant.nuq import (
    key_outliers,
    masked_range,
    nearest_code,
    normalize,
    scale_zero,
    topk_outlier_mask,
)
from kvbench.quant.packing import pack, unpack


class DenseSparseTokens:
    """Codebook codes of ``[B, H_kv, T, D]`` plus sparse fp16 outliers. ``channel_range`` (fp16
    ``(scale, zero)`` of shape ``[H_kv, D]``) selects per-channel fixed ranges; ``None`` per-token
    online ranges."""

    def __init__(self, levels: int, codebook: torch.Tensor, fraction: float, channel_range=None):
        self.levels, self.fraction = levels, fraction
        self.codebook = codebook.half()  # what is held
        self.channel_range = channel_range
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None  # per-token ranges (values)
        self.zero: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.cols: list[torch.Tensor] = []
        self.vals: list[torch.Tensor] = []
        self.num_tokens = 0
        self.shape: tuple[int, int, int] = (0, 0, 0)  # B, H, D

    def append(self, x: torch.Tensor) -> None:
        if x.shape[-2] == 0:
            return
        x = x.float()
        b, h, t, d = x.shape
        self.shape = (b, h, d)
        if self.channel_range is not None:
            scale, zero = (p.to(x.device)[None, :, None, :] for p in self.channel_range)
            mask = key_outliers(x, scale, zero, self.fraction)
        else:
            mask = topk_outlier_mask(x, self.fraction) if self.fraction > 0 else None
            scale, zero = scale_zero(*masked_range(x, mask))
            self.scale = scale if self.scale is None else torch.cat([self.scale, scale], dim=-2)
            self.zero = zero if self.zero is None else torch.cat([self.zero, zero], dim=-2)
        codes = pack(nearest_code(normalize(x, scale, zero), self.codebook.float().to(x.device)), self.levels)
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=-2)
        if mask is not None and bool(mask.any()):
            ib, ih, it, id_ = mask.nonzero(as_tuple=True)
            col_dtype = torch.int16 if b * h * d <= torch.iinfo(torch.int16).max else torch.int32
            self.rows.append((it + self.num_tokens).to(torch.int32))
            self.cols.append(((ib * h + ih) * d + id_).to(col_dtype))
            self.vals.append(x[mask].half())
        self.num_tokens += t

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``."""
        b, h, d = self.shape
        codes = unpack(self.codes, self.levels, d).long()
        if self.channel_range is not None:
            scale, zero = (p.float().to(codes.device)[None, :, None, :] for p in self.channel_range)
        else:
            scale, zero = self.scale.float(), self.zero.float()
        x = self.codebook.float().to(codes.device)[codes] * scale + zero
        if self.rows:
            rows = torch.cat(self.rows).long()
            cols = torch.cat(self.cols).long()
            flat = ((cols // d) * self.num_tokens + rows) * d + cols % d
            x.view(-1)[flat] = torch.cat(self.vals).float()
        return x

    def __len__(self) -> int:
        return self.num_tokens

    def num_outliers(self) -> int:
        return sum(v.numel() for v in self.vals)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.codes is None:
            return {}
        held = {"codes": [self.codes], "sparse": self.rows + self.cols + self.vals}
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
