"""Beam search over a kvbench cache: reordering its sequences between steps, or one clear refusal.

Beam search (``model.generate(..., num_beams=k)``) keeps ``batch * k`` sequences in the cache and,
after every step, asks it to take row ``beam_idx[i]`` as its new row ``i``
(:meth:`transformers.cache_utils.Cache.reorder_cache`). A kvbench layer can do that exactly when
everything it holds per sequence sits in token buffers with the batch first
(:class:`~kvbench.cache.growable.GrowableTokens`, ``[B, H_kv, capacity, X]``: codes, scales, zero
points, residual windows, sinks): each buffer is replaced by its ``index_select`` along the batch,
rows already written are never overwritten in place (views taken earlier keep their rows, as the
growable buffers promise), and the counts, which every row shares, stay as they are.

The rule is read from the layer itself, not from a table of methods: :func:`batch_buffers` walks
the layer's attributes (into kvbench objects and containers) and refuses any tensor that is not
inside such a buffer (eviction scores, kept positions, calibration tables, rings of the static
step, per-request plans...) and any buffer of the static step. A refused cache raises
:class:`BeamSearchError` before any layer is touched: one line naming what could not be reordered.
"""

from __future__ import annotations

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.errors import ConfigError


class BeamSearchError(ConfigError):
    """Beam search asked a cache to reorder state it cannot reorder."""

    def __init__(self, allowed: str):
        self.key, self.value, self.allowed = "num_beams", ">1", allowed
        ValueError.__init__(self, f"num_beams>1: {allowed}")


class _Unreorderable(Exception):
    def __init__(self, path: str, why: str):
        super().__init__(path, why)
        self.path, self.why = path, why


def _walk(obj, path: str, seen: set[int], found: list[GrowableTokens]) -> None:
    if isinstance(obj, GrowableTokens):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.static:
            raise _Unreorderable(path, "a buffer of the static decode step")
        found.append(obj)
        return
    if isinstance(obj, torch.Tensor):
        raise _Unreorderable(path, "a tensor outside the token buffers")
    if isinstance(obj, (dict, list, tuple, set, frozenset)):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            _walk(value, f"{path}[{key!r}]", seen, found)
        return
    if type(obj).__module__.startswith("kvbench.") and hasattr(obj, "__dict__"):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for name, value in vars(obj).items():
            _walk(value, f"{path}.{name}", seen, found)
    # anything else (numbers, strings, dtypes, devices, generators) holds no per-sequence tensor


def batch_buffers(layer) -> list[GrowableTokens]:
    """The token buffers of ``layer`` that hold its sequences, batch first; raises
    ``_Unreorderable`` (path, reason) at the first state that is not one."""
    found: list[GrowableTokens] = []
    _walk(layer, type(layer).__name__, set(), found)
    return found


def reorder_layers(layers, beam_idx: torch.Tensor) -> None:
    """Row ``i`` of every layer becomes row ``beam_idx[i]``, or :class:`BeamSearchError` with
    nothing changed. Layers that were never updated hold nothing and are left alone."""
    plan: list[GrowableTokens] = []
    rows = int(beam_idx.numel())
    for layer in layers:
        try:
            buffers = batch_buffers(layer)
        except _Unreorderable as err:
            raise BeamSearchError(
                f"beam search reorders the cache's sequences between steps, and a "
                f"{type(layer).__name__} cache cannot reorder {err.path} ({err.why}); use num_beams=1 "
                "(greedy or sampling), or a method whose cache holds only token buffers"
            ) from None
        for buffer in buffers:
            if buffer.buffer is not None and buffer.buffer.shape[0] != rows:
                raise BeamSearchError(
                    f"a {type(layer).__name__} buffer holds {buffer.buffer.shape[0]} sequences, beam "
                    f"search reorders {rows}"
                )
        plan.extend(b for b in buffers if b.buffer is not None)
    for buffer in plan:
        buffer.buffer = buffer.buffer.index_select(0, beam_idx.to(buffer.buffer.device))
