"""Per-head channel subsets of ``[B, H_kv, T, D]`` tensors: the gather and its inverse.

TurboQuant's outlier channels (:class:`~kvbench.cache.rotated.ChannelSplitCodes`) hold each head's
channels in two sets, each quantized on its own; the store gathers a set's channels on append and
scatters the sets back on reads, and the readers of every backend do the same around their kernels
(the query gathered to a set's channels, the mixed values scattered back). Both floors use these,
so they stand here, below the cache.
"""

from __future__ import annotations

import torch


def gather_channels(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``x [B, H_kv, T, D]`` at ``channels [H_kv, k]`` per head: ``[B, H_kv, T, k]``."""
    b, h, t, _ = x.shape
    return x.gather(-1, channels[None, :, None, :].expand(b, h, t, channels.shape[-1]))


def scatter_channels(parts: list[tuple[torch.Tensor, torch.Tensor]], dim: int) -> torch.Tensor:
    """Inverse of :func:`gather_channels` over a partition of the channels: ``(values [B, H_kv, T,
    k], channels [H_kv, k])`` pairs -> float32 ``[B, H_kv, T, dim]``."""
    b, h, t, _ = parts[0][0].shape
    out = torch.empty(b, h, t, dim, dtype=torch.float32, device=parts[0][0].device)
    for values, channels in parts:
        out.scatter_(-1, channels[None, :, None, :].expand(b, h, t, channels.shape[-1]), values.float())
    return out
