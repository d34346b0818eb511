"""One registry of how each backend reads each stored part, keyed by the part's type.

A stored part (a :class:`~kvbench.cache.source.TokenSource` of :mod:`kvbench.cache`: affine codes,
codebook codes, full-precision rows, a channel split, pre-RoPE keys, ...) declares in its own file,
next to its torch reference, which kernel answers its whole-part ``scores`` and ``mix`` on each
backend::

    register_reads(PerTokenAffineSource, "compiled", PartReads(scores=..., mix=...))

The way torchao pairs a config type with its handler: the table lives here, below the cache, and
never names a cache class; the cache's parts put themselves in it, and describe themselves to the
kernels in plain tensors (:class:`PackedCodes`, :class:`RopeTable`, a float ``[B, H_kv, T, D]``
tensor). So the kernels hold kernels and the plain-tensor calls into them (the readers' methods:
:class:`~kvbench.kernels.cpu.parts.CompiledReader`, :class:`~kvbench.kernels.triton_parts.TritonReader`),
the cache holds storage and which of those calls reads each part, and neither switches on the
other's classes. Adding a stored format touches its own file (storage, torch reference, one
registration per backend it has a kernel for), its kernels and its tests; a format with no
registration is read by its torch reference on the CPU and under ``backend=auto`` on CUDA, and
raises in the strict reader of ``backend=triton`` (a method that stores it must not list triton).

A binding is called as ``scores(reader, part, query)`` / ``mix(reader, part, weights)``, or with a
fourth argument ``rope`` when it declares ``rope=True`` (the part is read as keys stored before
RoPE, rotated to their positions inside the kernel; a :class:`RopeTable`). ``reader`` is the
backend's reader: the binding calls its plain-tensor methods, and reads nested parts through
:meth:`KernelReader.part_scores` / :meth:`KernelReader.part_mix` (a part built of others). A binding
returns the float32 ``[B, H_kv, M, T]`` logits / ``[B, H_kv, M, D]`` mix, or declines: None on the
compiled backend (the torch reference runs), NotImplementedError on Triton (the strict reader's
promise is broken; the lenient one runs the torch reference). ``covers(reader, part[, rope])``
answers, before anything runs, whether the backend reads that instance (Triton's strict reader
checks it; None means every instance of the type).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

BACKENDS = ("compiled", "triton")


class PackedCodes(NamedTuple):
    """Packed codes as the kernels read them, in plain tensors: token t, channel d reads back as
    ``table[c] * scale + zero`` (``c`` itself where ``table`` is None), overwritten by the exact
    ``outliers``.

    - ``codes``: uint8 ``[B, H_kv, T, packed_length(D, L)]`` (:mod:`kvbench.quant.packing`);
    - ``table``: float32 ``[L]`` codebook, or None for affine codes;
    - ``scale``, ``zero``: None or broadcastable to ``[B, H_kv, T, D]`` along the leading axes, with
      a token axis of T (one row per token), T // G (per-channel affine groups) or 1 (one fixed
      row), and a channel axis of D, D // G or 1;
    - ``outliers``: None or ``(rows, cols, vals)``, the dense-and-sparse entries (rows ascending,
      cols flat ``(b * H_kv + h) * D + d``).
    """

    codes: torch.Tensor
    levels: int
    head_dim: int
    table: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]


class RopeTable(NamedTuple):
    """The layer's RoPE table ``cos``, ``sin`` ``[P, D]`` by absolute position, and the position of
    the part's first token: keys stored before RoPE are rotated to ``first_position + t``."""

    cos: torch.Tensor
    sin: torch.Tensor
    first_position: int

    @property
    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


@dataclass(frozen=True)
class PartReads:
    """What one backend reads of one part type: whole-part ``scores`` and ``mix`` (None: not read
    by this backend), ``covers`` (None: every instance), and whether they take a :class:`RopeTable`."""

    scores: Callable[..., torch.Tensor | None] | None = None
    mix: Callable[..., torch.Tensor | None] | None = None
    covers: Callable[..., bool] | None = None
    rope: bool = False


# (part type's name, backend) -> reads. Keyed by the type's module and qualified name, a stable
# key that a part may also be registered under before its class is importable (a module the class's
# own module imports).
_READS: dict[tuple[str, str], PartReads] = {}


@functools.cache
def part_key(part_type: type) -> str:
    """The registry's key of a part type: ``module.QualifiedName``."""
    return f"{part_type.__module__}.{part_type.__qualname__}"


def register_reads(part_type: type | str, backend: str, reads: PartReads) -> None:
    """Declare how ``backend`` reads parts of exactly ``part_type`` (the class, or its
    :func:`part_key`). A subclass registers its own: it may store more than its base reads.
    Registering other reads for a type and backend that have some is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    key = (part_type if isinstance(part_type, str) else part_key(part_type), backend)
    if key in _READS and _READS[key] != reads:
        raise ValueError(f"{key[0]} already has {backend} reads registered")
    _READS[key] = reads


def reads_for(part: Any, backend: str) -> PartReads | None:
    """The reads ``backend`` registered for the type of ``part``, None when it has none."""
    return _READS.get((part_key(type(part)), backend))


class KernelReader:
    """The dispatch both kernel readers share (each is a :class:`~kvbench.cache.blockwise.PartReader`):
    a part's registered binding, called with the reader. A subclass sets ``backend`` and says what
    declining means (:meth:`decline`)."""

    backend: str = ""

    def decline(self, why: str) -> None:
        """A part (or layout) this backend does not read: return None, or raise."""
        return None

    def _binding(self, part, which: str, rope: RopeTable | None):
        reads = reads_for(part, self.backend)
        fn = None if reads is None else getattr(reads, which)
        if fn is None or rope is not None and not reads.rope:
            return None, reads
        return fn, reads

    def part_scores(self, part, query: torch.Tensor, rope: RopeTable | None = None) -> torch.Tensor | None:
        """``query [B, H_kv, M, D]`` float32 -> logits ``[B, H_kv, M, T]``, or the backend's decline."""
        fn, reads = self._binding(part, "scores", rope)
        if fn is None:
            return self.decline(f"the {self.backend} reader does not read {type(part).__name__} parts")
        return fn(self, part, query, rope) if reads.rope else fn(self, part, query)

    def part_mix(self, part, weights: torch.Tensor, rope: RopeTable | None = None) -> torch.Tensor | None:
        """``weights [B, H_kv, M, T]`` float32 -> ``[B, H_kv, M, D]``, or the backend's decline."""
        fn, reads = self._binding(part, "mix", rope)
        if fn is None:
            return self.decline(f"the {self.backend} reader does not read {type(part).__name__} parts")
        return fn(self, part, weights, rope) if reads.rope else fn(self, part, weights)

    def covers(self, part, rope: RopeTable | None = None) -> bool:
        """Whether this backend reads ``part`` (scores and mix), before anything runs."""
        reads = reads_for(part, self.backend)
        if reads is None or rope is not None and not reads.rope:
            return False
        if reads.covers is None:
            return True
        return reads.covers(self, part, rope) if reads.rope else reads.covers(self, part)
