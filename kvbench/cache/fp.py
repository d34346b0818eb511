"""Full-precision token buffers: the FP16 baseline's storage, residual windows, pending groups."""

from __future__ import annotations

import torch


class FullPrecisionTokens:
    """A growable ``[B, H_kv, T, D]`` tensor stored in ``dtype`` (float16 unless told otherwise)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.data: torch.Tensor | None = None

    def append(self, x: torch.Tensor) -> None:
        x = x.to(self.dtype)
        self.data = x if self.data is None else torch.cat([self.data, x], dim=-2)

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove and return the oldest ``n`` tokens."""
        front, rest = self.data[..., :n, :], self.data[..., n:, :]
        self.data = rest if rest.shape[-2] else None
        return front

    def __len__(self) -> int:
        return 0 if self.data is None else self.data.shape[-2]

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]
