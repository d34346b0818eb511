"""The storage protocol every part of a layer's cache follows.

A layer (:class:`~kvbench.cache.layer.KVLayer`) is composed of stores, each holding some of its
tokens: a quantized body (affine codes :class:`~kvbench.cache.quantized.QuantizedTokens`, rotated
codebook codes :class:`~kvbench.cache.rotated.RotatedCodes`, dense-and-sparse codes
:class:`~kvbench.cache.dense_sparse.DenseSparseTokens`), full-precision windows, sinks and pools
(:class:`~kvbench.cache.fp.FullPrecisionTokens`). The layer routes tokens between them (when a
window token moves to the body, which tokens a sink keeps) and concatenates their sources for
attention; a store only has to:

- ``append(x)``: take new tokens ``[B, H_kv, t, D]`` at O(t) cost (doubling buffers,
  :mod:`kvbench.cache.growable`);
- ``len(store)``: say how many tokens it holds;
- ``source()``: hand out what it holds as a block source (:mod:`kvbench.cache.source`) that
  attention reads a block at a time, and that keeps reading the same tokens after later appends;
- ``bytes_reserved()``: report its allocation, spare capacity included.

Stores of codes also report, for the accounting, ``held_tensors()`` (the tensors held, by
component), ``quantized_values()`` and ``nominal_code_bits()``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvbench.cache.source import TokenSource


@runtime_checkable
class Store(Protocol):
    def append(self, x: torch.Tensor) -> None: ...

    def __len__(self) -> int: ...

    def source(self) -> TokenSource | None: ...

    def bytes_reserved(self) -> int: ...


@runtime_checkable
class CodeStore(Store, Protocol):
    def held_tensors(self) -> dict[str, list[torch.Tensor]]: ...

    def quantized_values(self) -> int: ...

    def nominal_code_bits(self) -> float: ...
