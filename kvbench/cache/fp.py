"""Full-precision token buffers (the FP16 baseline's storage, residual windows, pending groups) and their
block source."""

from __future__ import annotations

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.cache.source import BlockSource
from kvbench.kernels.part_reads import PartReads, register_reads


class FullPrecisionSource(BlockSource):
    """Tokens ``[B, H_kv, T, D]`` held in any float dtype, upcast to float32 one block at a time."""

    def __init__(self, data: torch.Tensor):
        if data.dim() != 4 or not data.is_floating_point():
            raise ValueError(
                f"data must be a float tensor [B, H_kv, T, D], got {data.dtype} {tuple(data.shape)}"
            )
        self.data = data

    @property
    def num_tokens(self) -> int:
        return self.data.shape[-2]

    @property
    def num_heads(self) -> int:
        return self.data.shape[1]

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        return self.data[..., start:stop, :].float()


# The compiled and Triton reads of full-precision rows: the row kernels over the tensor held.
_ROWS_READS = PartReads(
    scores=lambda reader, part, query: reader.rows_scores(query, part.data),
    mix=lambda reader, part, weights: reader.rows_mix(weights, part.data),
)
for _backend in ("compiled", "triton"):
    register_reads(FullPrecisionSource, _backend, _ROWS_READS)


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

    # -- static mode (kvbench.cache.static) -----------------------------------------------------
    def reserve(self, capacity: int) -> None:
        self.buffer.reserve(capacity)

    def advance(self, t: int) -> None:
        self.buffer.advance(t)

    def static_source(self) -> tuple[FullPrecisionSource, torch.Tensor] | None:
        """The whole capacity as a source and the device count of rows written (None before the
        first append)."""
        full = self.buffer.full_view()
        return None if full is None else (FullPrecisionSource(full), self.buffer.length)
