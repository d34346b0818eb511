"""Full-precision token buffers: the FP16 baseline's storage, residual windows, pending groups."""

from __future__ import annotations

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.quant.blockwise import FullPrecisionSource


class FullPrecisionTokens:
    """A ``[B, H_kv, T, D]`` tensor stored in ``dtype`` (float16 unless told otherwise), in a doubling
    buffer (:class:`~kvbench.cache.growable.GrowableTokens`): appends and pops cost O(new tokens)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.buffer = GrowableTokens(dtype)

    @property
    def data(self) -> torch.Tensor | None:
        """The held tokens ``[B, H_kv, T, D]`` (a view of the buffer), None while empty."""
        return self.buffer.view() if len(self.buffer) else None

    def append(self, x: torch.Tensor) -> None:
        self.buffer.append(x)

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove and return the oldest ``n`` tokens."""
        return self.buffer.pop_front(n)

    def __len__(self) -> int:
        return len(self.buffer)

    def tensors(self) -> list[torch.Tensor]:
        return self.buffer.tensors()

    def source(self) -> FullPrecisionSource | None:
        """The held tokens as a block source (None while empty)."""
        data = self.data
        return None if data is None else FullPrecisionSource(data)

    def bytes_reserved(self) -> int:
        return self.buffer.bytes_reserved()
