"""The compiled CPU backend's reads of stored parts: its kernels called on plain tensors.

:class:`CompiledReader` is the :class:`~kvbench.cache.blockwise.PartReader` of the compiled CPU
backend. Which of its reads answers a part is declared by the part, in its own file, in the
registry of :mod:`kvbench.kernels.part_reads` (backend ``compiled``); the reader looks the part's
type up there and offers the reads as methods on plain tensors (float queries on the CPU):

- full-precision rows in fp16, bf16 or fp32 (:meth:`~CompiledReader.rows_scores`): read in place, no
  upcast copy;
- affine codes at any level count (:meth:`~CompiledReader.token_affine_scores` and the rest): KIVI's
  per-channel keys and per-token values through the folded kernels, the other two axis combinations
  through the generic code kernel;
- codebook codes (:meth:`~CompiledReader.codebook_scores`: KVQuant's nuq, TurboQuant's Lloyd-Max)
  with per-token or fixed scale and zero, a per-head rotation (the query is rotated before the
  scores and the mix after, two small matmuls) and dense-and-sparse outliers when there is no
  rotation (the kernel reads the dense codes, then one scatter-add per call puts back
  ``q . (exact - reconstructed)`` at the outlier entries);
- pre-RoPE keys over codebook codes (a :class:`~kvbench.kernels.part_reads.RopeTable` given): the
  kernel rotates every decoded row to its position from the layer's cos/sin table
  (``rope_code_scores`` in ``sparse.cpp``, a vector decoder, for power-of-two levels up to 16;
  ``code_scores`` otherwise), outliers corrected the same way.

Anything else (a part with no ``compiled`` reads, tensors off the CPU) returns None and runs its
torch reference; which backends ran is recorded (:func:`~kvbench.kernels.cpu.note_backend`).
"""

from __future__ import annotations

import torch

from kvbench.kernels.cpu import cpu_kernels, note_backend
from kvbench.kernels.outliers import _correct_mix, _correct_scores, _param_rows
from kvbench.kernels.part_reads import KernelReader, PackedCodes, RopeTable
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


class CompiledReader(KernelReader):
    """Whole-part scores and mixes through the compiled kernels ``module``."""

    backend = "compiled"

    def __init__(self, module):
        self.k = module

    def scores(self, part, query: torch.Tensor) -> torch.Tensor | None:
        out = self.part_scores(part, query) if _on_cpu(query) else None
        note_backend("torch" if out is None else "compiled")
        return out

    def mix(self, part, weights: torch.Tensor) -> torch.Tensor | None:
        out = self.part_mix(part, weights) if _on_cpu(weights) else None
        note_backend("torch" if out is None else "compiled")
        return out

    # -- the reads parts register (plain tensors; None where the layout is not taken) ------------
    def rows_scores(self, query, data: torch.Tensor):
        """Full-precision rows ``data [B, H_kv, T, D]`` (fp16, bf16 or fp32)."""
        return self.k.fp_scores(query, data) if _on_cpu(data) else None

    def rows_mix(self, weights, data: torch.Tensor):
        return self.k.fp_mix(weights, data) if _on_cpu(data) else None

    def channel_affine_scores(self, query, part: PackedCodes, group_size: int):
        """Affine codes with per-channel scale/zero over groups of ``group_size`` tokens."""
        if not _on_cpu(part.codes):
            return None
        c, m = chunk_layout(part.levels)
        return self.k.affine_channel_scores(
            query, part.codes, part.scale, part.zero, part.levels, part.head_dim, c, m, group_size
        )

    def channel_affine_mix(self, weights, part: PackedCodes, group_size: int):
        if not _on_cpu(part.codes):
            return None
        c, m = chunk_layout(part.levels)
        g = group_size
        return self.k.code_mix(
            weights, part.codes, _identity(part.levels), part.scale, part.zero, part.levels,
            part.head_dim, c, m, g, g,
        )  # fmt: skip

    def token_affine_scores(self, query, part: PackedCodes):
        """Affine codes with per-token scale/zero over channel groups."""
        if not _on_cpu(part.codes):
            return None
        c, m = chunk_layout(part.levels)
        ident = _identity(part.levels)
        t = part.num_tokens
        if _per_token(part.scale, t) and _per_token(part.zero, t):
            # one group per head: s_t (q . c_t) + z_t sum(q), the affine map off the codes
            return self.k.codebook_token_scores(
                query, part.codes, ident, part.scale, part.zero, part.levels, part.head_dim, c, m
            )
        return self.k.code_scores(
            query, part.codes, ident, part.scale, part.zero, part.levels, part.head_dim, c, m, 1, 1,
            None, None, 0,
        )  # fmt: skip

    def token_affine_mix(self, weights, part: PackedCodes, group_size: int):
        if not _on_cpu(part.codes):
            return None
        c, m = chunk_layout(part.levels)
        return self.k.affine_token_mix(
            weights, part.codes, part.scale, part.zero, part.levels, part.head_dim, c, m, group_size
        )

    def codebook_scores(self, query, part: PackedCodes, rotation=None, rope: RopeTable | None = None):
        """Codebook codes (``part.table``), rotated by ``rotation [H_kv, D, D]`` (the stored vectors
        are ``Pi x``) or, as pre-RoPE keys, to their positions by ``rope``; outliers corrected after
        the kernel. Not taken: outliers together with a rotation, a rotation together with RoPE."""
        if not _on_cpu(part.codes):
            return None
        if rope is not None:
            if rotation is not None:
                return None
            out = self._codebook_scores(part, query, rope)
            return out if part.outliers is None else _correct_scores(out, part, query, rope, self.k)
        if part.outliers is not None and rotation is not None:
            return None
        q = query if rotation is None else torch.matmul(query, rotation.transpose(-1, -2))
        out = self._codebook_scores(part, q, None)
        return out if part.outliers is None else _correct_scores(out, part, query, None, self.k)

    def _codebook_scores(self, part: PackedCodes, query, rope: RopeTable | None):
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

    def _rope_codebook_scores(self, part: PackedCodes, query, rope: RopeTable):
        """Pre-RoPE codebook keys through the vector decoder (outliers not included); None where it
        does not take the layout (levels other than 2, 4, 8, 16, head_dim not a multiple of 16)."""
        t = part.num_tokens
        cos, sin = rope.table
        return self.k.rope_code_scores(
            query, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim,
            _param_rows(part.scale, t), _param_rows(part.zero, t), cos, sin, rope.first_position,
        )  # fmt: skip

    def codebook_mix(self, weights, part: PackedCodes, rotation=None, rope: RopeTable | None = None):
        """The mix of codebook codes, rotated back by ``rotation``; pre-RoPE values are not taken."""
        if rope is not None or not _on_cpu(part.codes):
            return None
        if part.outliers is not None and rotation is not None:
            return None
        c, m = chunk_layout(part.levels)
        t = part.num_tokens
        if _per_token(part.scale, t) and _per_token(part.zero, t):
            out = self.k.codebook_token_mix(
                weights, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m
            )
        else:
            out = self.k.code_mix(
                weights, part.codes, part.table, part.scale, part.zero, part.levels, part.head_dim, c, m,
                _param_rows(part.scale, t), _param_rows(part.zero, t),
            )  # fmt: skip
        if rotation is not None:
            out = torch.matmul(out, rotation)
        return out if part.outliers is None else _correct_mix(out, part, weights, self.k)


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
