"""Sliding-window layers: the cache of a layer that attends only its newest tokens.

Rule: **layers with sliding-window attention hold their window in full precision in every method;
methods quantize / evict / prefetch full-attention layers only.** A model with sliding-window layers
(Gemma-3's local layers, Mistral v0.1, Qwen2 with ``use_sliding_window``) never attends a token
that has left a sliding layer's window, and transformers' own cache
(:class:`~transformers.cache_utils.DynamicSlidingWindowLayer`, which ``DynamicCache(config=...)``
builds for those layers) keeps just the newest ``sliding_window - 1`` tokens there. A kvbench cache
does the same in every method, in the method's ``fp_dtype``, so that:

- the FP16 reference of the memory report is what transformers holds (the window, not the whole
  sequence, in those layers: :meth:`KVLayer.reference_tokens`), and every "x vs FP16" figure is
  measured against the model's real cache;
- the masks transformers builds for those layers (``get_mask_sizes`` returns ``(kv_length,
  kv_offset)`` of the window) line up with what is stored, so eviction and other methods never see
  a mask that hides earlier tokens in the layers they manage.

:class:`SlidingWindowLayer` mirrors ``DynamicSlidingWindowLayer``: ``num_tokens`` is the cumulative
length (the position of the next token, what ``get_seq_length`` reports), the store holds
``min(num_tokens, sliding_window - 1)`` tokens in a doubling buffer
(:class:`~kvbench.cache.fp.FullPrecisionTokens`; the oldest are popped from its front), and a forward
attends the stored window blockwise plus its own exact tokens, like every kvbench layer
(:mod:`kvbench.cache.layer`). Past recording and cropping (assisted decoding) are not supported.

``store_limit`` lets a method that feeds tokens that are not part of the sequence (SpeCache's
speculative token, stored nowhere) say how many of the next forward's tokens are stored; None
stores them all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer, StoredTokens

# The accounting component of the windows' bytes.
WINDOW_COMPONENT = "window"


class SlidingWindowLayer(KVLayer):
    """The newest ``sliding_window - 1`` tokens in ``fp_dtype`` (transformers'
    ``DynamicSlidingWindowLayer`` in kvbench's storage and attention path)."""

    is_sliding = True

    def __init__(self, layer_idx: int, sliding_window: int, fp_dtype: torch.dtype):
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
        super().__init__(layer_idx)
        self.sliding_window = sliding_window
        self.capacity = sliding_window - 1  # tokens kept between forwards
        self.k, self.v = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)
        self.store_limit: int | None = None

    @property
    def cumulative_length(self) -> int:
        """Tokens seen so far (transformers' name for it)."""
        return self.num_tokens

    @property
    def window_tokens(self) -> int:
        """Tokens held now: ``min(num_tokens, sliding_window - 1)``."""
        return len(self.k)

    # -- storage ----------------------------------------------------------------------------------
    def append(self, keys, values):
        t = keys.shape[-2]
        keep = min(t, self.capacity)  # older tokens of a long forward never enter the buffer
        self.k.append(keys[..., t - keep :, :])
        self.v.append(values[..., t - keep :, :])
        over = len(self.k) - self.capacity
        if over > 0:
            self.k.pop_front(over)
            self.v.pop_front(over)

    def read(self):
        return self.k.data, self.v.data

    def stored(self) -> StoredTokens | None:
        if not len(self.k):
            return None
        return StoredTokens(self.k.source(), self.v.source())

    def held_tensors(self):
        return {WINDOW_COMPONENT: self.k.tensors() + self.v.tensors()}

    def bytes_reserved(self):
        return self.k.bytes_reserved() + self.v.bytes_reserved()

    def reference_tokens(self) -> int:
        return self.window_tokens

    # -- transformers' cache protocol -----------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """Take the stored window as sources, store this forward's tokens (the first
        ``store_limit`` of them when set) and return the forward's own tokens, which
        :meth:`KVLayer.attend` attends exactly after the window."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = self.stored()
        t = key_states.shape[-2]
        n = t if self.store_limit is None else min(self.store_limit, t)
        if n:
            self.append(key_states[..., :n, :], value_states[..., :n, :])
        self.num_tokens += n
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` exactly as ``DynamicSlidingWindowLayer``: the held window plus
        the queries, starting at the window's first position."""
        kv_offset = max(self.num_tokens - self.sliding_window + 1, 0)
        if self.num_tokens >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.num_tokens + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window


def with_window_layers(
    layers: list[KVLayer], sliding: Sequence[int], sliding_window: int | None, fp_dtype: torch.dtype
) -> list[KVLayer]:
    """``layers`` with every index in ``sliding`` holding a :class:`SlidingWindowLayer` (a layer that
    already is one is kept): the rule above enforced on a cache a method built by itself."""
    out = list(layers)
    for i in sliding:
        if not isinstance(out[i], SlidingWindowLayer):
            out[i] = SlidingWindowLayer(i, sliding_window, fp_dtype)
    return out
