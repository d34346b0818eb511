"""The ``kvbench`` attention implementation, registered with transformers.

Loading a model with ``attn_implementation="kvbench"`` routes every attention call through
:func:`kvbench_attention`, which hands it to the layer storage just updated
(:meth:`KVLayer.attend`), after recording it for an open
:func:`kvbench.cache.capture.capture_attention`. The matching mask entry is SDPA's boolean mask, so
transformers builds the same causal/padding masks it builds for ``sdpa``.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvbench.cache.cache import take_active_layer
from kvbench.cache.capture import active_capture

ATTN_IMPLEMENTATION = "kvbench"


def kvbench_attention(module, query, key, value, attention_mask, **kwargs):
    """``query [B, H, q, D]``, ``key/value [B, H_kv, k, D]`` as returned by the cache update."""
    capture = active_capture()
    if capture is not None:
        capture.record(module, query, key, value, kwargs)
    layer = take_active_layer(key)
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        # Not a kvbench cache (e.g. a plain forward without cache): ordinary SDPA.
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


register()
