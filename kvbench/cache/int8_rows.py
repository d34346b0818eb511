"""Int8 per-token rows: each head vector held as signed int8 codes and one fp16 scale.

A token's head vector ``x [D]`` is held as ``q = round(x / s)`` clamped to ``[-127, 127]`` (int8),
with ``s = max_d |x_d| / 127`` held in fp16 (symmetric absmax quantization per token and head, no
zero point; ``-128`` is never written, so the code range is symmetric). It reads back as
``x_hat = q * s``; the error of an element is at most ``s / 2`` (round to nearest, ties to even).
Per token and head the store holds ``D`` code bytes and 2 scale bytes: ``8 + 16 / D`` bits per
value.

The format is also a demonstration of issue 45 item 2 (a stored part owns its reads): this file
holds the storage (:class:`Int8RowTokens`), its torch reference (:class:`Int8RowSource`) and its one
registration in :mod:`kvbench.kernels.part_reads`. No kernel was written for it: the int8 bytes,
viewed as uint8, are codebook codes at 256 levels whose codebook is two's complement (byte ``b``
means ``b`` below 128 and ``b - 256`` from 128 on), scaled per token, which both backends' codebook
reads already take.
"""

from __future__ import annotations

import math

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.cache.source import BlockSource
from kvbench.kernels.part_reads import BACKENDS, PackedCodes, PartReads, register_reads

QMAX = 127
FP16_MAX = torch.finfo(torch.float16).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H_kv, t, D]`` -> int8 codes ``[B, H_kv, t, D]`` and fp16 scales ``[B, H_kv, t, 1]``.
    The codes are rounded against the fp16 scale that is held, so that ``q * s`` is the nearest
    representable value to ``x`` under what is stored. An all-zero row has scale 0 and codes 0."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / QMAX).clamp(max=FP16_MAX).to(torch.float16)
    s = scale.float()
    q = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-QMAX, QMAX)
    return q.to(torch.int8), scale


class Int8RowSource(BlockSource):
    """Stored int8 rows read back a range at a time: ``codes`` int8 ``[B, H_kv, T, D]``, ``scale``
    fp16 ``[B, H_kv, T, 1]``; token t reads ``codes[t] * scale[t]`` in float32."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        if codes.dtype != torch.int8 or codes.dim() != 4:
            raise ValueError(f"codes must be int8 [B, H_kv, T, D], got {codes.dtype} {tuple(codes.shape)}")
        if tuple(scale.shape) != (*codes.shape[:-1], 1):
            raise ValueError(
                f"scale must be [B, H_kv, T, 1] = {(*codes.shape[:-1], 1)}, got {tuple(scale.shape)}"
            )
        self.codes, self.scale = codes, scale

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]

    @property
    def num_heads(self) -> int:
        return self.codes.shape[1]

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        return self.codes[..., start:stop, :].float() * self.scale[..., start:stop, :].float()

    def packed(self) -> PackedCodes:
        """The same bytes as the kernels' codebook codes: uint8 at 256 levels, the two's-complement
        codebook, the per-token scale."""
        table = _twos_complement(self.codes.device)
        return PackedCodes(self.codes.view(torch.uint8), 256, self.codes.shape[-1], table, self.scale)


_TABLES: dict[str, torch.Tensor] = {}


def _twos_complement(device: torch.device) -> torch.Tensor:
    """float32 ``[256]``: the int8 value of each byte (built once per device)."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8, device=device).view(torch.int8).float()
    return _TABLES[key]


class Int8RowTokens:
    """A growing store of int8 per-token rows (:func:`quantize_rows`), in doubling buffers
    (:class:`~kvbench.cache.growable.GrowableTokens`): appends cost O(new tokens)."""

    def __init__(self):
        self._codes = GrowableTokens(torch.int8)
        self._scale = GrowableTokens(torch.float16)

    def append(self, x: torch.Tensor) -> None:
        """Quantize and store ``x [B, H_kv, t, D]``."""
        if x.shape[-2] == 0:
            return
        codes, scale = quantize_rows(x)
        self._codes.append(codes)
        self._scale.append(scale)

    def __len__(self) -> int:
        return len(self._codes)

    @property
    def codes(self) -> torch.Tensor | None:
        """int8 ``[B, H_kv, T, D]`` (a view of the rows in use), None while empty."""
        return self._codes.view() if len(self) else None

    @property
    def scale(self) -> torch.Tensor | None:
        """fp16 ``[B, H_kv, T, 1]``, None while empty."""
        return self._scale.view() if len(self) else None

    def source(self) -> Int8RowSource | None:
        """The stored tokens as a block source (None while empty); views, so it keeps reading what
        is stored now after later appends."""
        return Int8RowSource(self.codes, self.scale) if len(self) else None

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``: ``codes * scale``."""
        if not len(self):
            raise RuntimeError("empty Int8RowTokens")
        return self.codes.float() * self.scale.float()

    def bytes_reserved(self) -> int:
        return self._codes.bytes_reserved() + self._scale.bytes_reserved()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not len(self):
            return {}
        return {"codes": [self.codes], "scales": [self.scale]}

    def quantized_values(self) -> int:
        return 0 if not len(self) else self.codes.numel()

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(2 * QMAX + 1)


# -- what the kernels read of this part (kvbench.kernels.part_reads): the codebook reads ----------
_READS = PartReads(
    scores=lambda reader, part, query: reader.codebook_scores(query, part.packed()),
    mix=lambda reader, part, weights: reader.codebook_mix(weights, part.packed()),
)
for _backend in BACKENDS:
    register_reads(Int8RowSource, _backend, _READS)
