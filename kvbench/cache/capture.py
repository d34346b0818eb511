"""Capturing what a forward computes, per layer, for instruments that measure it (the hit-rate task,
the attention-error probe, SemKV's hidden-state metrics, KVQuant's calibration).

Two kinds of capture, one module:

- :func:`capture_attention`: inside the ``with`` block, every attention call that goes through the
  ``kvbench`` attention implementation (:mod:`kvbench.cache.attention`) is recorded per layer as an
  :class:`AttentionRecord`: the post-RoPE ``query [B, H, q, D]``, the ``keys``/``values
  [B, H_kv, k, D]`` the cache update returned (a layer that attends its stored tokens from packed
  storage returns only the forward's own tokens; with no kvbench cache, the forward's own states),
  and the logit ``scaling``. A layer called several times keeps its last
  call. It works with any method's cache and with plain cache-less forwards alike.
- :class:`OutputCapture`: forward hooks on a list of modules (decoder layers, projections) that keep,
  per module index, what ``reduce(inputs, kwargs, output)`` makes of each call (e.g. a norm of the
  hidden state rather than the state itself), until :meth:`OutputCapture.close`.

:func:`replay` then drives any method's layer with captured tensors, without the model: a prefill,
then decode steps through the layer's own ``update``/``attend`` (pools, evictions, query-adaptive
reads all run as in a real decode).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionRecord:
    """One attention call: ``query [B, H, q, D]``, ``keys``/``values [B, H_kv, k, D]`` (detached)."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float


class AttentionCapture:
    """Records of the layers in ``layers`` (None: every layer), by layer index."""

    def __init__(self, layers: Iterable[int] | None = None):
        self.layers = None if layers is None else set(layers)
        self.records: dict[int, AttentionRecord] = {}

    def record(self, module, query, keys, values, kwargs) -> None:
        idx = module.layer_idx
        if self.layers is None or idx in self.layers:
            scaling = float(kwargs.get("scaling") or module.scaling)
            self.records[idx] = AttentionRecord(query.detach(), keys.detach(), values.detach(), scaling)


_CAPTURE: contextvars.ContextVar[AttentionCapture | None] = contextvars.ContextVar(
    "kvbench_capture", default=None
)


def active_capture() -> AttentionCapture | None:
    """The capture the attention function records into, if a :func:`capture_attention` is open."""
    return _CAPTURE.get()


@contextmanager
def capture_attention(layers: Iterable[int] | None = None) -> Iterator[AttentionCapture]:
    """Record every kvbench attention call of the layers in ``layers`` inside the block."""
    capture = AttentionCapture(layers)
    token = _CAPTURE.set(capture)
    try:
        yield capture
    finally:
        _CAPTURE.reset(token)


class OutputCapture:
    """Forward hooks on ``modules``: after each call of module ``i``, ``records[i]`` is
    ``reduce(args, kwargs, output)`` (computed without gradients)."""

    def __init__(self, modules: list[torch.nn.Module], reduce: Callable[[tuple, dict, Any], Any]):
        self.records: dict[int, Any] = {}
        self.reduce = reduce
        self.handles = [
            m.register_forward_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(modules)
        ]

    def _hook(self, idx: int):
        def hook(_module, args, kwargs, output):
            with torch.no_grad():
                self.records[idx] = self.reduce(args, kwargs, output)

        return hook

    def close(self) -> None:
        """Remove the hooks (the records stay)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __enter__(self) -> OutputCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AttentionModule(torch.nn.Module):
    """What a layer's ``attend`` reads from the attention module, for :func:`replay`."""

    training = False
    is_causal = True

    def __init__(self, layer_idx: int, groups: int, scaling: float):
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.scaling = layer_idx, groups, scaling


@torch.no_grad()
def replay(
    layer,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefill: int,
    steps: int,
    scaling: float,
    attend_prefill: bool = False,
    before_attend: Callable[[int, Any], None] | None = None,
) -> list[torch.Tensor]:
    """Feed a cache layer captured ``query [B, H, N, D]``, ``keys``/``values [B, H_kv, N, D]``: the
    first ``prefill`` tokens in one update (attended too with ``attend_prefill``), then one token per
    step for ``steps`` steps, each attended by its own query. ``before_attend(t, layer)`` runs after
    position t is stored and before its query attends. Returns each step's attention output in
    transformers' layout ``[B, 1, H, D]``."""
    module = AttentionModule(layer.layer_idx, query.shape[1] // keys.shape[1], scaling)
    k, v = layer.update(keys[:, :, :prefill], values[:, :, :prefill])
    if attend_prefill:
        layer.attend(module, query[:, :, :prefill], k, v, None, scaling=scaling)
    outs = []
    for t in range(prefill, prefill + steps):
        k, v = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        if before_attend is not None:
            before_attend(t, layer)
        outs.append(layer.attend(module, query[:, :, t : t + 1], k, v, None, scaling=scaling)[0])
    return outs
