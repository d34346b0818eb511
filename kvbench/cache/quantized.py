"""Growable packed storage of quantized ``[B, H_kv, T, D]`` tensors.

Every backend holds the same bytes: ``torch`` runs :mod:`kvbench.quant` (the reference), ``auto``
the compiled CPU kernel where it covers the layout, ``triton`` the kernels of
:mod:`kvbench.kernels.quant_pack` (for kvbench's fp32 arithmetic; KIVI's released arithmetic has
only the reference), each bit-identical to the reference.

Layout (what is held, per block of tokens appended):

- ``codes``: ``uint8 [B, H_kv, T, packed_length(D, L)]``: each token's D codes packed along the
  channel axis (:mod:`kvbench.quant.packing`), whatever the quantization axis, so that blocks
  concatenate along tokens.
- ``scale``, ``zero``: ``param_dtype`` (fp16 by default);
  ``[B, H_kv, T, D // G]`` for ``axis="token"`` (per-token statistics over groups of G channels),
  ``[B, H_kv, T // G, D]`` for ``axis="channel"`` (per-channel statistics over groups of G tokens).

Each is held in a doubling buffer (:class:`~kvbench.cache.growable.GrowableTokens`), so an append
costs O(new tokens); ``codes``/``scale``/``zero`` are views of the rows in use, and
:meth:`QuantizedTokens.source` reads them block by block for attention
(:mod:`kvbench.cache.affine_source`) without reconstructing the store.
"""

from __future__ import annotations

import math

import torch

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.growable import GrowableTokens
from kvbench.kernels.cpu import cpu_kernels
from kvbench.quant.affine import dequantize_grouped, quantize_grouped
from kvbench.quant.packing import chunk_layout, pack, unpack

# What quantize_pack reads and stores parameters in (kvbench.kernels.quant_pack; it imports triton).
QUANT_PACK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantizedTokens:
    def __init__(
        self,
        levels: int,
        axis: str,
        group_size: int | None,
        zero_point: str = "minmax",
        param_dtype: torch.dtype | None = torch.float16,
        backend: str = "torch",
        arithmetic: str = "fp32",
    ):
        if axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
        self.levels, self.axis, self.group_size = levels, axis, group_size
        self.zero_point, self.param_dtype = zero_point, param_dtype
        self.backend, self.arithmetic = backend, arithmetic
        # tokens per scale/zero row
        self.param_rows = group_size if axis == "channel" and group_size else 1
        # KIVI's arithmetic keeps its parameters in the input's dtype: the buffers take the first one's
        kept = None if arithmetic == "kivi" else param_dtype
        self._codes = GrowableTokens(torch.uint8)
        self._scale = GrowableTokens(kept, tokens_per_row=self.param_rows)
        self._zero = GrowableTokens(kept, tokens_per_row=self.param_rows)
        self.num_tokens = 0
        self.head_dim = 0

    def append(self, x: torch.Tensor) -> None:
        """Quantize and store ``x [B, H_kv, t, D]``. For ``axis="channel"`` t must be a multiple of G."""
        if x.shape[-2] == 0:
            return
        kernel = self._triton_append(x) if self.backend == "triton" else self._compiled_append(x)
        if kernel is not None:
            packed, scale, zero = kernel
        else:
            codes, scale, zero = quantize_grouped(
                x,
                self.levels,
                self.axis,
                self.group_size,
                zero_point=self.zero_point,
                param_dtype=self.param_dtype,
                arithmetic=self.arithmetic,
            )
            packed = pack(codes, self.levels)
        self.head_dim = x.shape[-1]
        self._codes.append(packed)
        self._scale.append(scale)
        self._zero.append(zero)
        if not self.static:  # a static store counts on advance()
            self.num_tokens += x.shape[-2]

    def _triton_append(self, x: torch.Tensor):
        """``(packed, scale, zero)`` of ``x`` from :func:`~kvbench.kernels.quant_pack.quantize_pack`
        (two launches, bit-identical to the reference), or None where that kernel does not apply:
        KIVI's released arithmetic (input dtype, round half to even), which only the reference
        implements, or parameters kept in no dtype."""
        if self.arithmetic != "fp32" or self.param_dtype not in QUANT_PACK_DTYPES:
            return None
        if self.zero_point not in ("minmax", "specache") or x.dtype not in QUANT_PACK_DTYPES:
            return None
        from kvbench.kernels.quant_pack import quantize_pack

        return quantize_pack(x, self.levels, self.axis, self.group_size, self.zero_point, self.param_dtype)

    def _compiled_append(self, x: torch.Tensor):
        """``(packed, scale, zero)`` of ``x`` from the compiled CPU kernel (one call instead of the
        reference's ~30 operations; bit-identical to it), or None where it does not apply: another
        backend or device, per-channel groups, or a zero point the kernel does not know."""
        if self.backend != "auto" or self.axis != "token" or x.device.type != "cpu":
            return None
        if self.zero_point == "specache" and (self.levels != 2 or self.arithmetic == "kivi"):
            return None
        if self.zero_point not in ("minmax", "specache"):
            return None
        if self.param_dtype is None and self.arithmetic != "kivi":
            return None
        module = cpu_kernels()
        if module is None:
            return None
        c, m = chunk_layout(self.levels)
        group = self.group_size or x.shape[-1]
        if x.shape[-1] % group:
            return None  # the reference raises the error that names the sizes
        packed, scale, zero = module.token_quantize_pack(
            x, self.levels, group, 1 if self.arithmetic == "kivi" else 0, int(self.zero_point == "specache"),
            self.param_dtype or torch.float32, c, m,
        )  # fmt: skip
        return packed, scale, zero

    # views of the rows in use (None while empty)
    @property
    def codes(self) -> torch.Tensor | None:
        return self._codes.view() if self.num_tokens else None

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale.view() if self.num_tokens else None

    @property
    def zero(self) -> torch.Tensor | None:
        return self._zero.view() if self.num_tokens else None

    def source(self):
        """The stored tokens as a block source (:mod:`kvbench.cache.affine_source`), None while empty.
        Views, so it keeps reading what is stored now after later appends."""
        if not self.num_tokens:
            return None
        if self.axis == "token":
            return PerTokenAffineSource.from_store(self)
        if self.group_size is None:
            return None  # one group per append: no fixed group size (a uniform config rejects it)
        return PerChannelAffineSource.from_store(self)

    def bytes_reserved(self) -> int:
        return sum(b.bytes_reserved() for b in (self._codes, self._scale, self._zero))

    # -- static mode (kvbench.cache.static) ------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Hold ``capacity`` tokens in fixed buffers with a device-side count (per-channel axis: a
        multiple of G, appended in whole groups)."""
        if self.axis == "channel" and (not self.group_size or capacity % self.group_size):
            raise ValueError(
                f"a static per-channel store holds whole groups: {capacity} tokens, G={self.group_size}"
            )
        self._codes.reserve(capacity)
        self._scale.reserve(capacity // self.param_rows)
        self._zero.reserve(capacity // self.param_rows)

    @property
    def static(self) -> bool:
        return self._codes.static

    @property
    def written(self) -> torch.Tensor | None:
        """Static mode: tokens written, counted on the device (int64 ``[1]``)."""
        return self._codes.length

    def allocate_like(self, x: torch.Tensor) -> None:
        """Static mode: allocate the buffers for tokens shaped like ``x [B, H_kv, t, D]`` without
        storing any (a layer whose prefill stores none here still reads the store's full shape)."""
        if self._codes.full_view() is not None:
            return
        probe = torch.zeros(*x.shape[:-2], self.param_rows, x.shape[-1], dtype=x.dtype, device=x.device)
        codes, scale, zero = quantize_grouped(
            probe, self.levels, self.axis, self.group_size, zero_point=self.zero_point,
            param_dtype=self.param_dtype, arithmetic=self.arithmetic,
        )  # fmt: skip
        self.head_dim = x.shape[-1]
        for buf, part in ((self._codes, pack(codes, self.levels)), (self._scale, scale), (self._zero, zero)):
            buf.append(part[..., :0, :])  # a static buffer allocates on its first append, even of 0

    def advance(self, t: int) -> None:
        self._codes.advance(t)
        self._scale.advance(t // self.param_rows)
        self._zero.advance(t // self.param_rows)
        self.num_tokens += t

    def static_source(self):
        """``(source, length)``: the whole capacity as a per-token source (unwritten tokens have
        zero codes, scale and zero) and the device count of tokens written; None before the first
        append."""
        codes = self._codes.full_view()
        if codes is None:
            return None
        group = self.group_size or self.head_dim
        kind = PerTokenAffineSource if self.axis == "token" else PerChannelAffineSource
        source = kind(
            codes, self._scale.full_view(), self._zero.full_view(), self.levels, group, self.head_dim
        )
        return source, self._codes.length

    def dequantize(self) -> torch.Tensor:
        """``float32 [B, H_kv, T, D]``; an empty store has no shape to give and raises."""
        if not self.num_tokens:
            raise RuntimeError("empty QuantizedTokens")
        if self.backend == "triton":
            from kvbench.kernels.quant_pack import unpack_dequantize

            return unpack_dequantize(
                self.codes, self.scale, self.zero, self.levels, self.axis, self.group_size, self.head_dim
            )
        codes = unpack(self.codes, self.levels, self.head_dim)
        return dequantize_grouped(codes, self.scale, self.zero, self.axis, self.group_size)

    def __len__(self) -> int:
        return self.num_tokens

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not self.num_tokens:
            return {}
        return {"codes": [self.codes], "scales": [self.scale], "zeros": [self.zero]}

    def quantized_values(self) -> int:
        if not self.num_tokens:
            return 0
        codes = self.codes
        return codes.shape[0] * codes.shape[1] * self.num_tokens * self.head_dim

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)
