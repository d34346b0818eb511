"""Lossless leading tokens in front of any layer storage (IntactKV, KVQuant's attention sink).

The first ``capacity`` tokens of the sequence are kept in full precision; every later token goes
to the wrapped layer, through its ``append``. Reading and attending put the sink tokens first, as
they are in the sequence, followed by the wrapped layer's stored sources (a method's own attention
path, if it has one, is not used behind a sink).
"""

from __future__ import annotations

import torch

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer, StoredTokens, cat_tokens, concat_stored, merge_held


class SinkLayer(KVLayer):
    def __init__(self, inner: KVLayer, capacity: int, fp_dtype: torch.dtype):
        super().__init__(inner.layer_idx)
        self.inner, self.capacity = inner, capacity
        self.sink_k, self.sink_v = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)

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
        return cat_tokens(self.sink_k.data, inner[0]), cat_tokens(self.sink_v.data, inner[1])

    def bytes_reserved(self):
        return self.inner.bytes_reserved() + self.sink_k.bytes_reserved() + self.sink_v.bytes_reserved()

    def held_tensors(self):
        sink = {"sink": self.sink_k.tensors() + self.sink_v.tensors()}
        return merge_held(self.inner.held_tensors(), sink)

    def quantized_values(self):
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
        return self.inner.nominal_code_bits()
