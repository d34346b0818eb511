"""The kvbench cache: a transformers ``Cache`` whose layers are a method's :class:`KVLayer`s.

The attention contract, the one place it is written down:

- A forward over a kvbench cache passes the cache twice: as transformers' ``cache`` (which calls
  :meth:`KVBenchCache.update` layer by layer) and as the keyword :data:`ATTENTION_KWARG`, which
  transformers hands on untouched to the attention function of every layer (as every decoder of
  ``tests/tiny_archs.py`` does). :meth:`KVBenchCache.forward_kwargs` builds both;
  :meth:`kvbench.generate.ModelRunner.forward` and every other forward in kvbench use it.
  transformers itself never gives the attention function the cache, hence the second argument.
- :meth:`KVBenchCache.update` lets the layer store the forward's tokens and remembers, on this
  cache, which keys the layer returned; the layer keeps what it took from storage for its own
  :meth:`KVLayer.attend` (:attr:`KVLayer.stored_for_attention`).
- The attention function (:func:`kvbench.cache.attention.kvbench_attention`) asks the cache it was
  handed for the layer of its module (:meth:`KVBenchCache.layer_to_attend`) and calls its
  ``attend``. No state outside the cache object is involved, so two caches used in turn, layer by
  layer, never see each other's tokens.
- A forward without the keyword (no cache, or transformers' own) is plain SDPA over what it is
  given; a forward over a kvbench cache without the keyword is refused at its first update where
  the model passes its attention keywords to the cache (Llama, Mistral, Qwen2, Gemma and most
  decoders of transformers 5); elsewhere it would attend only the forward's own tokens.
- A model prepared by :func:`kvbench.prepare` adds the keyword itself to every forward given a
  kvbench cache as ``cache=``/``past_key_values=`` (a forward pre-hook, :mod:`kvbench.cache.hf`),
  so ``model.generate(ids, cache=cache)``, pipelines and plain ``model(ids, cache=cache)`` keep
  this contract without knowing it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from kvbench.cache.accounting import MemoryReport, memory_report
from kvbench.cache.layer import KVLayer
from kvbench.cache.recorder import active_recorder
from kvbench.cache.reorder import reorder_layers

# The keyword under which a forward hands its kvbench cache to the attention function.
ATTENTION_KWARG = "kvbench_cache"


class KVBenchCache(Cache):
    """A cache made of one :class:`KVLayer` per transformer layer."""

    # The method that built this cache, where the builder says (kvbench.new_cache): a prepared
    # model's forward hook runs its after_forward for forwards that kvbench's runner does not make.
    method = None

    def __init__(self, layers: list[KVLayer]):
        super().__init__(layers=layers)
        # layer index -> the keys its latest update returned, until attention takes that layer
        self._returned: dict[int, torch.Tensor] = {}

    def memory_report(self) -> MemoryReport:
        """What the cache holds now, from its tensors (:mod:`kvbench.cache.accounting`): bytes per
        component, ``effective_bits``, ``code_bits``, ``compression``..."""
        return memory_report(self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes row ``beam_idx[i]`` in every layer, where each layer's
        sequences live in token buffers only; else one :class:`~kvbench.cache.reorder.BeamSearchError`
        line, nothing changed (:mod:`kvbench.cache.reorder`)."""
        reorder_layers(self.layers, beam_idx)

    def forward_kwargs(self) -> dict[str, Any]:
        """The keywords of a model forward over this cache: ``model(input_ids=ids,
        **cache.forward_kwargs())``."""
        return {"cache": self, "use_cache": True, ATTENTION_KWARG: self}

    # -- the static step (kvbench.cache.static) --------------------------------------------------
    @property
    def static(self) -> bool:
        return any(getattr(layer, "static", False) for layer in self.layers)

    def reserve(self, capacity: int) -> None:
        """Preallocate every layer for ``capacity`` tokens with device-side lengths (before the
        first forward)."""
        for layer in self.layers:
            layer.reserve(capacity)

    def advance(self, t: int) -> None:
        """Count the ``t`` tokens per layer that the latest forward stored on the device."""
        for layer in self.layers:
            layer.advance(t)

    def step_kind(self) -> tuple:
        """The kind of the next static step (:meth:`KVLayer.step_kind` of every layer)."""
        return tuple(layer.step_kind() for layer in self.layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check_handed_to_attention(self, kwargs)
        recorder = active_recorder()
        if recorder is not None:
            recorder.on_update(self, layer_idx, key_states, value_states, kwargs)
        layer = self.layers[layer_idx]
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        self._returned[layer_idx] = keys
        return keys, values

    def layer_to_attend(self, layer_idx: int | None, keys: torch.Tensor) -> KVLayer | None:
        """The layer whose latest :meth:`update` returned ``keys`` ``[B, H_kv, k, D]``, once (a
        second call for the same update gets None). None too when the attention call reads other
        keys than that update returned (a model that shares or recomputes keys), so that the
        caller falls back to attending ``keys`` as given."""
        returned = self._returned.pop(layer_idx, None) if layer_idx is not None else None
        if returned is None or returned is not keys:
            return None
        return self.layers[layer_idx]


def check_handed_to_attention(cache, update_kwargs: dict) -> None:
    """Raise unless the forward calling ``cache.update`` also handed ``cache`` to attention: when the
    model passes its attention keywords (``update_kwargs["kwargs"]``) and this cache is not among
    them, the attention function would attend only what update returns."""
    forward = update_kwargs.get("kwargs")
    if isinstance(forward, dict) and forward.get(ATTENTION_KWARG) is not cache:
        raise RuntimeError(
            f"a forward over a kvbench cache must hand it to attention too: call the model with "
            f"**cache.forward_kwargs() (keyword {ATTENTION_KWARG!r}), not cache=cache alone, or "
            f"prepare the model once with kvbench.prepare(model), after which cache=, "
            f"past_key_values= and model.generate() hand it on"
        )
