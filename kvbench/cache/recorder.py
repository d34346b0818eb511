"""Recording one prefill forward over one cache, for :mod:`kvbench.cache.prefill` to hand to other
caches. The cache (:meth:`kvbench.cache.KVBenchCache.update`) and the attention function
(:func:`kvbench.cache.attention.kvbench_attention`) report to the open :class:`PrefillRecorder`; this
module imports neither, so both can import it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerPrefill:
    """One layer's part of a prefill forward: the cache update's inputs and keywords, and what the
    attention function was handed besides the keys (module, query, mask, keywords)."""

    keys: torch.Tensor
    values: torch.Tensor
    update_kwargs: dict[str, Any]
    module: Any = None
    query: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    attention_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrefillRecord:
    """A whole prefill: each layer's :class:`LayerPrefill` and the logits the forward returned
    (float32 ``[1, r, vocab]``, the rows the runner kept)."""

    layers: dict[int, LayerPrefill]
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        tensors = [self.logits]
        for layer in self.layers.values():
            tensors += [layer.keys, layer.values]
            tensors += [t for t in (layer.query, layer.mask) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keywords of a recorded call with every cache taken out (transformers' ``Cache`` and kvbench's
    alike, known by their ``layers``): a record must not hold the first arm's cache alive, and each
    replay hands its own."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, dict):
            v = _without_cache(v)
        elif hasattr(v, "layers") and hasattr(v, "update"):
            continue
        out[k] = v
    return out


class PrefillRecorder:
    """Collects one forward's :class:`LayerPrefill` per layer (see the module docstring)."""

    def __init__(self, cache):
        self.cache = cache
        self.layers: dict[int, LayerPrefill] = {}
        self.complete = True

    def on_update(self, cache, layer_idx: int, keys, values, kwargs: dict[str, Any]) -> None:
        if cache is not self.cache:
            return
        if layer_idx in self.layers:
            self.complete = False  # a layer updated twice is not a plain prefill
        self.layers[layer_idx] = LayerPrefill(keys.clone(), values.clone(), _without_cache(kwargs))

    def on_attention(self, cache, module, query, mask, kwargs: dict[str, Any]) -> None:
        if cache is not self.cache:
            return
        layer = self.layers.get(getattr(module, "layer_idx", None))
        if layer is None or layer.query is not None:
            self.complete = False
            return
        layer.module, layer.query = module, query.clone()
        layer.mask = mask.clone() if isinstance(mask, torch.Tensor) else mask
        layer.attention_kwargs = _without_cache(kwargs)

    def finish(self, logits: torch.Tensor) -> PrefillRecord | None:
        """The record, or None when the forward was not one plain update and attention per layer."""
        n = len(self.cache.layers)
        whole = self.complete and sorted(self.layers) == list(range(n))
        if not whole or any(layer.query is None for layer in self.layers.values()):
            return None
        return PrefillRecord(dict(self.layers), logits.detach().clone())


_RECORDER: contextvars.ContextVar[PrefillRecorder | None] = contextvars.ContextVar(
    "kvbench_prefill_recorder", default=None
)


def active_recorder() -> PrefillRecorder | None:
    return _RECORDER.get()


@contextmanager
def record_prefill(cache) -> Iterator[PrefillRecorder]:
    """Record the forward over ``cache`` made inside the block."""
    recorder = PrefillRecorder(cache)
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)
