"""Default-type rotary position embedding (RoPE) and its exact inverse, for pre-RoPE key storage.

Convention of transformers' Llama (the "rotate half" layout): channel ``j < d/2`` pairs with channel
``j + d/2``, both turned by the angle ``p * w_j`` of the token position ``p``, with

    w_j = theta^(-2j/d),                       j = 0 .. d/2 - 1
    RoPE(x, p) = x * cos(p w) + rotate_half(x) * sin(p w),   rotate_half([a, b]) = [-b, a]

where ``cos``/``sin`` repeat the d/2 angles twice. The inverse is the rotation by the opposite
angle, ``x * cos(p w) - rotate_half(x) * sin(p w)``. Angles are computed in float32 exactly as
transformers computes them (``inv_freq = 1 / theta ** (arange(0, d, 2) / d)``, ``p * inv_freq``), so
inverting the model's own rotation is exact up to float32 rounding.
"""

from __future__ import annotations

import torch


def inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[dim / 2]``: ``theta^(-2j/dim)``."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (float(theta) ** exponents)


def cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``, ``sin`` of shape ``[T, dim]`` for integer ``positions [T]``."""
    freqs = positions.float()[:, None] * inv_freq(dim, theta, positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of ``x [..., T, D]`` with precomputed ``cos``/``sin [T, D]``, float32."""
    xf = x.float()
    return xf * cos - rotate_half(xf) * sin if inverse else xf * cos + rotate_half(xf) * sin


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool) -> torch.Tensor:
    if positions.dim() != 1 or positions.shape[0] != x.shape[-2]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [T] with T = {x.shape[-2]}")
    cos, sin = cos_sin(positions.to(x.device), x.shape[-1], theta)
    return rotate(x, cos, sin, inverse)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE of ``x [..., T, D]`` at ``positions [T]``, float32."""
    return _rotate(x, positions, theta, False)


def invert_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: the pre-RoPE ``x [..., T, D]``, float32."""
    return _rotate(x, positions, theta, True)
