"""Full-precision outlier pools: tokens held exactly beside a quantized store, at their positions."""

from __future__ import annotations

from typing import NamedTuple

import torch

EMPTY = -1  # position of an unused pool slot


class Pool(NamedTuple):
    """Full-precision tokens ``k, v [B, H_kv, n, D]`` at positions ``pos [B, H_kv, n]`` (int32;
    ``EMPTY`` marks an unused slot)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos]


def place(x: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` with ``tokens [B, H, n, D]`` written at ``pos [B, H, n]`` (slots at
    ``EMPTY`` are skipped): they go to a scratch row past the end that is then dropped."""
    t = x.shape[-2]
    padded = torch.cat([x, x.new_zeros(*x.shape[:-2], 1, x.shape[-1])], dim=-2)
    idx = torch.where(pos >= 0, pos, t).long()[..., None].expand(*pos.shape, x.shape[-1])
    return padded.scatter(-2, idx, tokens.to(x.dtype))[..., :t, :]
