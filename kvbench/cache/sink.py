"""Lossless leading tokens in front of any layer storage (IntactKV, KVQuant's attention sink).

The first ``capacity`` tokens of the sequence are kept in full precision; every later token goes
to the wrapped layer, through its ``append``. Reading and attending put the sink tokens first, as
they are in the sequence, followed by the wrapped layer's stored sources (a method's own attention
path, if it has one, is not used behind a sink).

The sink's keys and values are two stores (:mod:`kvbench.cache.store`), full-precision ones
(:class:`~kvbench.cache.fp.FullPrecisionTokens`) unless :meth:`SinkLayer.hold_in` gives it others
before the first token arrives: a store of codes (IntactKV's low-bit pivot KV, a per-token affine
:class:`~kvbench.cache.quantized.QuantizedTokens`) is read through its source and dequantized, and
is counted as codes are (its ``codes``/``scales``/``zeros`` components, quantized values and
nominal bits join the wrapped layer's); a full-precision sink is the ``sink`` component.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer, StoredTokens, cat_tokens, concat_stored, merge_held
from kvbench.cache.store import CodeStore, Store


class SinkLayer(KVLayer):
    def __init__(self, inner: KVLayer, capacity: int, fp_dtype: torch.dtype):
        super().__init__(inner.layer_idx)
        self.inner, self.capacity = inner, capacity
        self.sink_k, self.sink_v = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)

    def hold_in(self, make_store: Callable[[], Store]) -> None:
        """Hold the sink's keys and values in two fresh stores from ``make_store`` instead of full
        precision (before the first token arrives)."""
        if len(self.sink_k):
            raise ValueError("hold_in() must come before the sink holds any token")
        self.sink_k, self.sink_v = make_store(), make_store()

    def _coded(self) -> bool:
        return isinstance(self.sink_k, CodeStore)

    def _sink_data(self, store):
        """What ``store`` holds ``[B, H_kv, t, D]`` (dequantized from codes), None while empty."""
        if not len(store):
            return None
        return store.dequantize() if self._coded() else store.data

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.inner.lazy_initialization(key_states, value_states)

    def append(self, keys, values):
        take = min(self.capacity - len(self.sink_k), keys.shape[-2])
        if take:
            self.sink_k.append(keys[..., :take, :])
            self.sink_v.append(values[..., :take, :])
        if keys.shape[-2] > take:
            self.inner.append(keys[..., take:, :], values[..., take:, :])
            self.inner.num_tokens += keys.shape[-2] - take

    def stored(self) -> StoredTokens | None:
        sink = StoredTokens(self.sink_k.source(), self.sink_v.source()) if len(self.sink_k) else None
        inner = self.inner.stored() if self.inner.num_tokens else None
        if self.inner.num_tokens and inner is None:
            return None
        return concat_stored([sink, inner], [len(self.sink_k), self.inner.num_tokens])

    def read(self):
        inner = self.inner.read() if self.inner.num_tokens else (None, None)
        keys, values = self._sink_data(self.sink_k), self._sink_data(self.sink_v)
        return cat_tokens(keys, inner[0]), cat_tokens(values, inner[1])

    def bytes_reserved(self):
        return self.inner.bytes_reserved() + self.sink_k.bytes_reserved() + self.sink_v.bytes_reserved()

    def held_tensors(self):
        if self._coded():
            return merge_held(
                self.inner.held_tensors(), self.sink_k.held_tensors(), self.sink_v.held_tensors()
            )
        sink = {"sink": self.sink_k.tensors() + self.sink_v.tensors()}
        return merge_held(self.inner.held_tensors(), sink)

    def quantized_values(self):
        if self._coded():
            return (
                self.inner.quantized_values()
                + self.sink_k.quantized_values()
                + self.sink_v.quantized_values()
            )
        return self.inner.quantized_values()

    def read_stats(self):
        return self.inner.read_stats()

    def read_traffic(self):
        return self.inner.read_traffic()

    def host_tensors(self):
        return self.inner.host_tensors()

    def prefetch_stats(self):
        return self.inner.prefetch_stats()

    def nominal_code_bits(self):
        if self._coded():
            own = self.sink_k.nominal_code_bits() + self.sink_v.nominal_code_bits()
            return self.inner.nominal_code_bits() + own
        return self.inner.nominal_code_bits()
