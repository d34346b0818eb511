"""A layer whose keys and values each live in a store of codes plus a full-precision window.

Most quantizing methods hold the same four parts: ``kq``/``vq``, the stores of quantized keys and
values (anything with ``__len__``, ``dequantize()``, ``held_tensors()``, ``quantized_values()`` and
``nominal_code_bits()``: :class:`~kvbench.cache.quantized.QuantizedTokens`,
:class:`~kvbench.cache.rotated.RotatedCodes`), and ``k_res``/``v_res``, the newest tokens still in
full precision (:class:`~kvbench.cache.fp.FullPrecisionTokens`). This base hands them out as block
sources in token order (quantized first, then the window; keys and values may split at different
tokens), reconstructs them for the reference :meth:`read`, and reports what they hold; a method only
says, in :meth:`append`, when a token moves from the window to the store. A store with no
``source()`` makes the layer take the reconstructing path.
"""

from __future__ import annotations

import torch

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer, StoredTokens, cat_tokens, merge_held
from kvbench.cache.source import ConcatSource


class CompositeLayer(KVLayer):
    """Subclasses set ``kq``, ``vq`` (stores) and ``k_res``, ``v_res`` (full-precision windows)."""

    kq: object
    vq: object
    k_res: FullPrecisionTokens
    v_res: FullPrecisionTokens

    @staticmethod
    def dequantized(store) -> torch.Tensor | None:
        """A store's tokens reconstructed ``[B, H_kv, T, D]``, None while it is empty."""
        return store.dequantize() if len(store) else None

    def stored(self) -> StoredTokens | None:
        parts = []
        for store, window in ((self.kq, self.k_res), (self.vq, self.v_res)):
            quantized = store.source() if len(store) else None
            if len(store) and quantized is None:
                return None
            parts.append(ConcatSource([quantized, window.source()]))
        return StoredTokens(*parts)

    def bytes_reserved(self) -> int:
        return sum(x.bytes_reserved() for x in (self.kq, self.vq, self.k_res, self.v_res))

    def read(self):
        return cat_tokens(self.dequantized(self.kq), self.k_res.data), cat_tokens(
            self.dequantized(self.vq), self.v_res.data
        )

    def held_tensors(self):
        residual = {"residual": self.k_res.tensors() + self.v_res.tensors()}
        return merge_held(self.kq.held_tensors(), self.vq.held_tensors(), residual)

    def quantized_values(self):
        return self.kq.quantized_values() + self.vq.quantized_values()

    def nominal_code_bits(self):
        return self.kq.nominal_code_bits() + self.vq.nominal_code_bits()
