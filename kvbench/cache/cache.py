"""The kvbench cache: a transformers ``Cache`` whose layers are a method's :class:`KVLayer`s."""

from __future__ import annotations

import contextvars

import torch
from transformers.cache_utils import Cache

from kvbench.cache.layer import KVLayer

# The layer that was updated last. A transformers attention module calls ``cache.update`` and then
# its attention function, one layer at a time, so the attention function finds its storage here
# without the model having to pass the cache along.
_ACTIVE_LAYER: contextvars.ContextVar[tuple[KVLayer, torch.Tensor] | None] = contextvars.ContextVar(
    "kvbench_layer", default=None
)


def take_active_layer(key: torch.Tensor | None = None) -> KVLayer | None:
    """The layer just updated, once: the pointer is cleared so a later forward over another cache
    (or none) never finds a stale layer. With ``key``, only if the attention call reads the keys that
    update returned (a forward without a kvbench cache, after a bare ``update``, gets None)."""
    active = _ACTIVE_LAYER.get()
    _ACTIVE_LAYER.set(None)
    if active is None:
        return None
    layer, returned = active
    return layer if key is None or key is returned else None


class KVBenchCache(Cache):
    """A cache made of one :class:`KVLayer` per transformer layer."""

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        out = layer.update(key_states, value_states, *args, **kwargs)
        _ACTIVE_LAYER.set((layer, out[0]))
        return out
