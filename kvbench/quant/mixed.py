"""Two-level token-wise mixed precision: how many tokens get the higher level count, which ones,
and how a two-store split is merged back into token order (SemKV, arXiv 2608.28911).

Between two grid points ``b_lo = log2 L_lo < b_hi = log2 L_hi`` a target average width ``b`` is
reached by giving the fraction

    p = (b - b_lo) / (b_hi - b_lo)

of the tokens the higher level count. Tokens are allocated in units (the prefill, then chunks of
generated tokens); a unit of n tokens gets ``k = round(p * N_after) - H_before`` high tokens, where
``N_after`` is the number of tokens allocated once this unit is included and ``H_before`` the high
tokens given so far. This is ``round(p * n)`` with the rounding remainder carried from unit to unit:
after every unit the high count is ``round(p * N)``, so the realized average width is within
``(b_hi - b_lo) / (2 N)`` of the target for every prefix of the sequence (exact whenever p N is an
integer), instead of drifting by up to half a token per chunk.
"""

from __future__ import annotations

import math

import torch

from kvbench.quant.levels import BITS_TOLERANCE
from kvbench.quant.packing import pack, unpack

_EPS = 1e-9  # p * N is computed in floating point; 12.9999999 must round like 13


def high_fraction(target_bits: float, low_levels: int, high_levels: int) -> float:
    """``p`` of the module docstring; raises ValueError outside ``[log2 L_lo, log2 L_hi]`` widened by
    :data:`~kvbench.quant.levels.BITS_TOLERANCE` at each end (the tolerance every bit width gets:
    ``2.585`` names log2 6 = 2.58496 here as it does for a uniform quantizer), clamped into [0, 1]."""
    lo, hi = math.log2(low_levels), math.log2(high_levels)
    if not lo < hi:
        raise ValueError(f"need low_levels < high_levels, got {low_levels}, {high_levels}")
    if not lo - BITS_TOLERANCE <= target_bits <= hi + BITS_TOLERANCE:
        raise ValueError(f"target {target_bits} outside [{lo:.4f}, {hi:.4f}]")
    return min(max((target_bits - lo) / (hi - lo), 0.0), 1.0)


class RunningAllocator:
    """High-token counts per allocation unit with the rounding remainder carried across units."""

    def __init__(self, p: float):
        self.p = p
        self.allocated = 0  # N: tokens allocated so far
        self.high = 0  # H: of which high

    def take(self, n: int) -> int:
        """How many of the next ``n`` tokens get the higher level count."""
        total = self.allocated + n
        want = math.floor(self.p * total + 0.5 + _EPS)
        k = min(max(want - self.high, 0), n)
        self.allocated, self.high = total, self.high + k
        return k


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask, same shape as ``scores [..., n]``, with exactly ``k`` True per row along the
    last axis: the k largest scores (ties: the earlier token first; NaN counts as -inf)."""
    n = scores.shape[-1]
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if k <= 0:
        return mask
    if k >= n:
        return mask.fill_(True)
    s = torch.nan_to_num(scores.float(), nan=-math.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    return mask.scatter_(-1, order[..., :k], True)


def split_by_mask(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, n, D]`` -> (``[B, H, k, D]`` where mask, ``[B, H, n - k, D]`` elsewhere), each in
    token order; every (b, h) row of ``mask [B, H, n]`` must hold the same count k."""
    b, h, n, d = x.shape
    k = int(mask[0, 0].sum()) if mask.numel() else 0
    return x[mask].reshape(b, h, k, d), x[~mask].reshape(b, h, n - k, d)


def merge_by_mask(mask: torch.Tensor, high: torch.Tensor | None, low: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`split_by_mask`: float32 ``[B, H, n, D]`` for ``mask [B, H, n]``."""
    ref = high if high is not None else low
    out = torch.empty(*mask.shape, ref.shape[-1], dtype=torch.float32, device=ref.device)
    if high is not None:
        out[mask] = high.float().reshape(-1, ref.shape[-1])
    if low is not None:
        out[~mask] = low.float().reshape(-1, ref.shape[-1])
    return out


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """One bit per token: uint8 ``[..., ceil(n / 8)]``."""
    return pack(mask.to(torch.uint8), 2)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    return unpack(packed, 2, n).bool()
