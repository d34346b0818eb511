"""Progressive codes and budgeted prefix allocation (ReadKV, "Query-adaptive reads of a progressive
KV cache", Amazon / UC Berkeley).

Progressive code. A value is stored once as a B-bit affine code ``q`` in ``[0, 2^B - 1]`` with
scale ``s`` and zero ``z`` (reconstruction ``z + s * q``, :mod:`kvbench.quant.affine`). Its top p
bits, the prefix ``q >> (B - p)``, name a bin of ``2^(B-p)`` consecutive codes; reading only the
prefix reconstructs at the centre of that bin:

    x_p = z + s * ((prefix + 0.5) * 2^(B-p) - 0.5)

At p = B this is ``z + s * q``, the stored B-bit reconstruction, bit for bit. At p = 0 nothing is
read and x_0 is the centre of the group's range. Since the code's own rounding error is at most
``s / 2`` and the code lies at most ``s * (2^(B-p) - 1) / 2`` from its bin centre,

    |x_p - x| <= s * 2^(B-p) / 2      (for x inside the group's [min, max], as every stored x is).

Allocation. Items (key channels, value tokens) with weights ``w_i`` receive prefix lengths
``p_i`` in ``0..B`` minimising the calibrated distortion ``sum_i w_i^2 4^(-p_i)`` (the variance of a
uniform error of width ``s 2^(B-p)``, weighted) under ``sum_i p_i <= budget``. The gain of the
(j+1)-th bit of item i, ``(3/4) w_i^2 4^(-j)``, falls geometrically in j ("diminishing refinement
gains"), so taking the ``budget`` largest gains over all (item, bit) pairs is exactly optimal and
hands each item a prefix of its bits: that is :func:`allocate_prefix_bits`. The order of the gains
is the order of ``w_i 2^(-j)``, so the linear objective ``sum_i w_i 2^(-p_i)`` gets the same
allocation.
"""

from __future__ import annotations

import torch


def prefix_reconstruct(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, prefix_bits: torch.Tensor | int
) -> torch.Tensor:
    """Float32 ``x_p`` of the module docstring. ``codes`` are the B-bit codes (any int dtype);
    ``scale``, ``zero`` and ``prefix_bits`` (integers in 0..B) broadcast against them."""
    # centre of every (prefix length, code) pair, looked up: [(B + 1) * 2^B]
    levels = 2**bits
    code = torch.arange(levels, device=codes.device)
    shift = bits - torch.arange(bits + 1, device=codes.device)[:, None]
    width = (torch.ones_like(shift) << shift).float()  # 2^(B-p), exact
    table = (((code >> shift).float() + 0.5) * width - 0.5).reshape(-1)
    p = torch.as_tensor(prefix_bits, device=codes.device).long()
    centre = table[p * levels + codes.long()]
    return centre * scale.float() + zero.float()


def allocate_prefix_bits(weights: torch.Tensor, bits: int, budget: int | torch.Tensor) -> torch.Tensor:
    """Prefix lengths ``p [..., N]`` (int64, each in 0..B) for item weights ``[..., N]`` (>= 0):
    the ``min(budget, N * B)`` largest refinement gains ``w_i 2^(-j)``, ``j < B``, of each row,
    counted per item (an item has B gains, so p_i <= B). Every row spends exactly
    ``min(budget, N * B)`` bits; among equal gains the choice is topk's."""
    *lead, n = weights.shape
    k = min(int(budget), n * bits)
    if k <= 0:
        return torch.zeros(*lead, n, dtype=torch.long, device=weights.device)
    step = torch.pow(0.5, torch.arange(bits, device=weights.device, dtype=torch.float32))
    gains = (weights.float()[..., :, None] * step).reshape(*lead, n * bits)  # item-major
    chosen = torch.topk(gains, k, dim=-1, sorted=False).indices // bits
    counts = torch.zeros(*lead, n, dtype=torch.long, device=weights.device)
    return counts.scatter_add_(-1, chosen, torch.ones_like(chosen))
