"""Test helpers: a layer's stored sources laid out densely, for comparing with the reference read."""

from __future__ import annotations

import torch


def dense_stored(stored, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys and values ``[B, H_kv, length, D]`` of a :class:`~kvbench.cache.layer.StoredTokens`,
    every entry written at its position (entries at -1 or replaced dropped). Positions not covered are NaN, so
    that a test comparing with a reference notices a missing token."""
    from kvbench.cache.blockwise import replaced_positions

    n = stored.num_entries
    keys, values = stored.keys.read(0, n), stored.values.read(0, n)
    positions = stored.positions
    if stored.replaced is not None:
        positions = replaced_positions(stored.replaced.long(), n)
    if positions is None:
        assert n == length
        return keys, values
    b, h, _, d = keys.shape
    out = []
    for x in (keys, values):
        dense = torch.full((b, h, length + 1, d), float("nan"))
        pos = torch.where(positions >= 0, positions, length)
        dense.scatter_(2, pos[..., None].expand(b, h, n, d), x)
        out.append(dense[:, :, :length])
    return out[0], out[1]
