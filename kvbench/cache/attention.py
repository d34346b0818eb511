"""The ``kvbench`` attention implementation and its registration with transformers.

:func:`register_attention` is the one place kvbench touches transformers' attention and mask registries;
importing this module registers nothing. The model builder (:func:`kvbench.builder.load_for_methods`)
calls it before loading a model with ``attn_implementation="kvbench"``, and
:func:`use_kvbench_attention` calls it for a model built in memory (tests, scripts).

A model using it routes every attention call through :func:`kvbench_attention`, which hands it to
the storage of the cache passed as :data:`~kvbench.cache.cache.ATTENTION_KWARG` (the contract is
written down in :mod:`kvbench.cache.cache`), after recording it for an open
:func:`kvbench.cache.capture.capture_attention`. The matching mask entry (:func:`kvbench_mask`) is
SDPA's boolean mask, so transformers builds the same padding, sliding-window and custom masks it
builds for ``sdpa``, except the plain causal mask of an unpadded batch, which is None: kvbench's
attention lets every query see every stored token and applies the causal rule among the forward's
own tokens itself, which is that mask, so building and reading it in every layer of a decode step
would be work for nothing.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

from kvbench.cache.cache import KVBenchCache
from kvbench.cache.capture import active_capture
from kvbench.cache.masks import newest_causal_mask
from kvbench.cache.recorder import active_recorder

ATTN_IMPLEMENTATION = "kvbench"


def kvbench_attention(module, query, key, value, attention_mask, kvbench_cache=None, **kwargs):
    """``query [B, H, q, D]``, ``key/value [B, H_kv, k, D]`` as returned by the cache update;
    ``kvbench_cache``: the forward's :class:`KVBenchCache` (None in a forward over no cache or
    transformers' own, which is ordinary SDPA). Returns ``(out [B, q, H, D], None)``."""
    capture = active_capture()
    if capture is not None:
        capture.record(module, query, key, value, kwargs)
    layer = None
    recorder = active_recorder()
    if recorder is not None:
        recorder.on_attention(kvbench_cache, module, query, attention_mask, kwargs)
    if isinstance(kvbench_cache, KVBenchCache):
        layer = kvbench_cache.layer_to_attend(getattr(module, "layer_idx", None), key)
    if layer is None:
        q, kv = query.shape[-2], key.shape[-2]
        if attention_mask is None and 1 < q < kv:
            attention_mask = newest_causal_mask(q, kv, query.device)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, **kwargs)


def kvbench_mask(*args, **kwargs):
    """transformers' SDPA mask (``sdpa_mask``, same arguments), or None for the plain causal mask of
    the newest tokens with no padding: no 2-D ``attention_mask``, the plain causal pattern (no
    sliding window, packing or overlay, which transformers marks by another ``mask_function`` or by
    forbidding the skip), keys from position 0 up to the last query. :func:`kvbench_attention` and
    the layers apply that rule themselves when the mask is None."""
    plain = (
        not args
        and kwargs.get("attention_mask") is None
        and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("local_size") is None
        and kwargs.get("allow_is_causal_skip", True)
        and kwargs.get("kv_offset", 0) == 0
        # the queries are the newest tokens (a static cache's keys run past them)
        and isinstance(kwargs.get("q_offset", 0), int)
        and kwargs.get("q_offset", 0) + kwargs.get("q_length", -1) == kwargs.get("kv_length")
    )
    return None if plain else sdpa_mask(*args, **kwargs)


def register_attention() -> str:
    """Register :func:`kvbench_attention` and its mask under :data:`ATTN_IMPLEMENTATION` (again
    is harmless); returns the name to load or set a model with."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, kvbench_mask)
    return ATTN_IMPLEMENTATION


def use_kvbench_attention(model):
    """Switch an in-memory ``model`` to kvbench attention (registering it first); returns it."""
    model.set_attn_implementation(register_attention())
    return model
