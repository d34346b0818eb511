"""Which compiled kernel answers each stored part, and the few torch ops around it.

:class:`CompiledReader` is the :class:`~kvbench.cache.blockwise.PartReader` of the compiled CPU
backend. Covered (everything on the CPU, float32 queries):

- full-precision rows in fp16, bf16 or fp32 (:class:`FullPrecisionSource`): read in place, no upcast
  copy;
- affine codes at any level count (:class:`PerChannelAffineSource`, :class:`PerTokenAffineSource`):
  KIVI's per-channel keys and per-token values through the folded kernels, the other two axis
  combinations through the generic code kernel;
- codebook codes (:class:`CodebookSource`: KVQuant's nuq, TurboQuant's Lloyd-Max) with per-token or
  fixed scale and zero, a per-head rotation (the query is rotated before the scores and the mix
  after, two small matmuls) and dense-and-sparse outliers when there is no rotation (the kernel
  reads the dense codes, then one scatter-add per call puts back ``q . (exact - reconstructed)``
  at the outlier entries);
- pre-RoPE keys over codebook codes (:class:`RoPESource`, KVQuant): the kernel rotates every
  decoded row to its position from the layer's cos/sin table (``rope_code_scores`` in
  ``sparse.cpp``, a vector decoder, for power-of-two levels up to 16; ``code_scores`` otherwise),
  outliers corrected the same way.

Anything else returns None and runs its torch reference; which backends ran is recorded
(:func:`~kvbench.kernels.cpu.note_backend`).
"""

from __future__ import annotations

import torch

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.source import RoPESource, TokenSource
from kvbench.kernels.cpu import cpu_kernels, note_backend
from kvbench.kernels.outliers import _correct_mix, _correct_scores, _param_rows
from kvbench.quant.packing import chunk_layout

_IDENTITY: dict[int, torch.Tensor] = {}


def _identity(levels: int) -> torch.Tensor:
    if levels not in _IDENTITY:
        _IDENTITY[levels] = torch.arange(levels, dtype=torch.float32)
    return _IDENTITY[levels]


def _per_token(x: torch.Tensor | None, tokens: int) -> bool:
    """Whether a codebook scale/zero is absent or one number per token (``[B, H_kv, T, 1]``), the
    case the folded codebook kernels take."""
    return x is None or x.shape[-1] == 1 and x.shape[-2] == tokens


def _on_cpu(*xs) -> bool:
    return all(x is None or x.device.type == "cpu" for x in xs)


class CompiledReader:
    """Whole-part scores and mixes through the compiled kernels ``module``."""

    def __init__(self, module):
        self.k = module

    # -- scores ---------------------------------------------------------------------------------
    def scores(self, part: TokenSource, query: torch.Tensor) -> torch.Tensor | None:
        out = self._scores(part, query) if _on_cpu(query) else None
        note_backend("torch" if out is None else "compiled")
        return out

    def _scores(self, part, query):
        k = self.k
        if type(part) is FullPrecisionSource and _on_cpu(part.data):
            return k.fp_scores(query, part.data)
        if type(part) is PerChannelAffineSource and _on_cpu(part.codes):
            c, m = chunk_layout(part.levels)
            return k.affine_channel_scores(
                query, part.codes, part.scale, part.zero, part.levels, part.head_dim, c, m, part.group_size
            )
        if type(part) is PerTokenAffineSource and _on_cpu(part.codes):
            c, m = chunk_layout(part.levels)
            ident = _identity(part.levels)
            t = part.num_tokens
            if _per_token(part.scale, t) and _per_token(part.zero, t):
                # one group per head: s_t (q . c_t) + z_t sum(q), the affine map off the codes
                return k.codebook_token_scores(
                    query, part.codes, ident, part.scale, part.zero, part.levels, part.head_dim, c, m
                )
            return k.code_scores(
                query, part.codes, ident, part.scale, part.zero, part.levels, part.head_dim, c, m, 1, 1,
                None, None, 0,
            )  # fmt: skip
        if type(part) is CodebookSource and _on_cpu(part.codes):
            if part.outliers is not None and part.rotation is not None:
                return None
            q = query if part.rotation is None else torch.matmul(query, part.rotation.transpose(-1, -2))
            out = self._codebook_scores(part, q, None)
            return out if part.outliers is None else _correct_scores(out, part, query, None, self.k)
        if type(part) is RoPESource and type(part.inner) is CodebookSource and part.table is not None:
            inner = part.inner
            if inner.rotation is not None or not _on_cpu(inner.codes):
                return None
            out = self._codebook_scores(inner, query, part)
            return out if inner.outliers is None else _correct_scores(out, inner, query, part, self.k)
        return None

    def _codebook_scores(self, part: CodebookSource, query, rope: RoPESource | None):
        c, m = chunk_layout(part.levels)
        t = part.num_tokens
        if rope is None and _per_token(part.scale, t) and _per_token(part.zero, t):
            return self.k.codebook_token_scores(
                query, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m
            )
        cos = sin = None
        offset = 0
        if rope is not None:
            cos, sin = rope.table
            offset = rope.first_position
            out = self._rope_codebook_scores(part, query, rope)
            if out is not None:
                return out
        return self.k.code_scores(
            query, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m,
            _param_rows(part.scale, t), _param_rows(part.zero, t), cos, sin, offset,
        )  # fmt: skip

    def _rope_codebook_scores(self, part: CodebookSource, query, rope: RoPESource):
        """Pre-RoPE codebook keys through the vector decoder (outliers not included); None where it
        does not take the layout (levels other than 2, 4, 8, 16, head_dim not a multiple of 16)."""
        t = part.num_tokens
        cos, sin = rope.table
        return self.k.rope_code_scores(
            query, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim,
            _param_rows(part.scale, t), _param_rows(part.zero, t), cos, sin, rope.first_position,
        )  # fmt: skip

    # -- mix ------------------------------------------------------------------------------------
    def mix(self, part: TokenSource, weights: torch.Tensor) -> torch.Tensor | None:
        out = self._mix(part, weights) if _on_cpu(weights) else None
        note_backend("torch" if out is None else "compiled")
        return out

    def _mix(self, part, weights):
        k = self.k
        if type(part) is FullPrecisionSource and _on_cpu(part.data):
            return k.fp_mix(weights, part.data)
        if type(part) is PerTokenAffineSource and _on_cpu(part.codes):
            c, m = chunk_layout(part.levels)
            return k.affine_token_mix(
                weights, part.codes, part.scale, part.zero, part.levels, part.head_dim, c, m, part.group_size
            )
        if type(part) is PerChannelAffineSource and _on_cpu(part.codes):
            c, m = chunk_layout(part.levels)
            g = part.group_size
            return k.code_mix(
                weights, part.codes, _identity(part.levels), part.scale, part.zero, part.levels,
                part.head_dim, c, m, g, g,
            )  # fmt: skip
        if type(part) is CodebookSource and _on_cpu(part.codes):
            if part.outliers is not None and part.rotation is not None:
                return None
            c, m = chunk_layout(part.levels)
            t = part.num_tokens
            if _per_token(part.scale, t) and _per_token(part.zero, t):
                out = k.codebook_token_mix(
                    weights, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m
                )
            else:
                out = k.code_mix(
                    weights, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m,
                    _param_rows(part.scale, t), _param_rows(part.zero, t),
                )  # fmt: skip
            if part.rotation is not None:
                out = torch.matmul(out, part.rotation)
            return out if part.outliers is None else _correct_mix(out, part, weights, self.k)
        return None


def read_kernels(backend: str, device: torch.device | str | None):
    """The reader a layer's decode reads go through (a :class:`~kvbench.cache.blockwise.PartReader`):

    - ``triton``: the Triton kernels (:class:`~kvbench.kernels.triton_parts.TritonReader`, strict:
      a method reaches it only when every part it stores is covered);
    - ``auto`` on a CUDA device with triton installed: the same kernels, not strict (a part they do
      not cover runs its torch reference, and the run records both backends);
    - ``auto`` on the CPU: the compiled kernels when they built;
    - otherwise None: the torch reference (``torch``, or ``auto`` where nothing built).

    The Triton module is imported only here, on first use: importing triton at module level would
    freeze the interpreter choice (``TRITON_INTERPRET``) before a test or a run has set it."""
    kind = None if device is None else torch.device(device).type
    if backend == "triton" or backend == "auto" and kind == "cuda" and _triton_ready():
        from kvbench.kernels.triton_parts import TritonReader

        return TritonReader(strict=backend == "triton")
    if backend != "auto" or (kind is not None and kind != "cpu"):
        note_backend("torch")
        return None
    module = cpu_kernels()
    if module is None:
        note_backend("torch")
        return None
    return CompiledReader(module)


def _triton_ready() -> bool:
    from kvbench.kernels.runtime import triton_available

    return triton_available()
