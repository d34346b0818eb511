"""Lossless leading tokens in front of any layer storage (IntactKV, KVQuant's attention sink).

The first ``capacity`` tokens of the sequence are kept in full precision; every later token goes
to the wrapped layer. Reading puts the sink tokens first, as they are in the sequence.
"""

from __future__ import annotations

import torch

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer, cat_tokens, merge_held


class SinkLayer(KVLayer):
    def __init__(self, inner: KVLayer, capacity: int, fp_dtype: torch.dtype):
        super().__init__(inner.layer_idx)
        self.inner, self.capacity = inner, capacity
        self.sink_k, self.sink_v = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.inner.lazy_initialization(key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        # The wrapped layer is driven through the generic read-then-append path, so any method
        # composes; a method's own attention shortcut (fused kernels, pools) is bypassed here.
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        take = min(self.capacity - len(self.sink_k), key_states.shape[-2])
        past_k, past_v = self.sink_k.data, self.sink_v.data
        if take:
            self.sink_k.append(key_states[..., :take, :])
            self.sink_v.append(value_states[..., :take, :])
        rest_k, rest_v = key_states[..., take:, :], value_states[..., take:, :]
        if rest_k.shape[-2]:
            inner_k, inner_v = KVLayer.update(self.inner, rest_k, rest_v)
        elif self.inner.num_tokens:
            inner_k, inner_v = self.inner.read()
        else:
            inner_k = inner_v = None
        self.num_tokens += key_states.shape[-2]
        new_k = key_states[..., :take, :] if take else None
        new_v = value_states[..., :take, :] if take else None
        keys = cat_tokens(past_k, new_k, inner_k).to(key_states.dtype)
        values = cat_tokens(past_v, new_v, inner_v).to(value_states.dtype)
        return keys, values

    def append(self, keys, values):  # update() routes tokens itself
        raise NotImplementedError

    def read(self):
        inner = self.inner.read() if self.inner.num_tokens else (None, None)
        return cat_tokens(self.sink_k.data, inner[0]), cat_tokens(self.sink_v.data, inner[1])

    def held_tensors(self):
        sink = {"sink": self.sink_k.tensors() + self.sink_v.tensors()}
        return merge_held(self.inner.held_tensors(), sink)

    def quantized_values(self):
        return self.inner.quantized_values()

    def read_stats(self):
        return self.inner.read_stats()

    def host_tensors(self):
        return self.inner.host_tensors()

    def prefetch_stats(self):
        return self.inner.prefetch_stats()

    def nominal_code_bits(self):
        return self.inner.nominal_code_bits()
