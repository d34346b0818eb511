"""A kvbench cache wherever transformers takes a cache: ``model.generate()``, pipelines, plain calls.

:func:`prepare_model` switches a model to kvbench's attention implementation and installs two
forward hooks on it; afterwards a kvbench cache given as ``cache=`` (or the deprecated
``past_key_values=``) to ``model(...)``, to ``model.generate(...)`` (greedy, sampling, beam search
where the cache can reorder, streamers) or to a text-generation pipeline is stored and attended
exactly as in kvbench's own loop (:class:`kvbench.generate.ModelRunner`).

Why hooks on the model. A kvbench cache is a transformers :class:`~transformers.cache_utils.Cache`
already (:class:`~kvbench.cache.cache.KVBenchCache`): its layers store every forward's tokens in the
method's format. What transformers 5.24 never does is hand the cache to the attention function:
attention gets the forward's ``**kwargs`` and the tensors ``update`` returned, and a kvbench layer
returns only the forward's own tokens, having taken the stored ones as block sources for its
``attend`` (no full-precision copy of the cache, the read rule of :mod:`kvbench.cache.layer`). So the
cache also rides in the forward's keywords (:data:`~kvbench.cache.cache.ATTENTION_KWARG`, the
contract of :mod:`kvbench.cache.cache`), and ``generate()`` refuses that keyword (its
``_validate_model_kwargs`` accepts only the forward's named arguments and ``TransformersKwargs``).
The ways considered:

- updates that return the whole cache dequantized, so that plain SDPA needs nothing more: a
  full-precision copy per layer per step, another read path than kvbench's blockwise one (other
  numbers than ``ModelRunner``), and the memory it claims to save;
- writing the keyword into the attention keywords from ``update`` (transformers passes them to
  ``update`` as ``kwargs=``): only where a model does that, and it would silently accept forwards
  that kvbench refuses today as a safety net (a model whose layers never see the keyword);
- a custom generation mixin or an override of ``_validate_model_kwargs``: private transformers code
  that changes between releases, and it covers ``generate()`` only, not pipelines or plain calls;
- a forward pre-hook on the model (chosen): every call of the model, from ``generate()``, a
  pipeline or a user, goes through ``module.__call__``, where the hook adds the keyword when the
  call carries a kvbench cache without it. The forward is then exactly ``ModelRunner.forward``'s
  (same keywords), so greedy tokens equal ``ModelRunner.generate``'s; nothing in transformers is
  patched, and an unprepared model keeps the refusal.

The second hook (after the forward) runs the method's :meth:`~kvbench.methods.Method.after_forward`
on forwards the hook completed, for a cache whose :attr:`~kvbench.cache.cache.KVBenchCache.method`
is known (:func:`kvbench.new_cache` sets it), as ``ModelRunner.forward`` does after each of its own;
a method that reads every prompt position's logits (:meth:`~kvbench.methods.Method.needs_prefill_logits`)
gets them (``logits_to_keep=0`` on those forwards; ``generate()`` reads the last row only).

What ``generate()`` cannot run: a method with its own decode step (SpeCache's speculative
two-token forward, :meth:`~kvbench.methods.Method.decode_step`), refused by :func:`kvbench.new_cache`;
beam search over a cache that cannot reorder its storage (:mod:`kvbench.cache.reorder`, one line);
assisted decoding (kvbench caches cannot be cropped; transformers says so). A batch of several
prompts in one ``generate()`` goes through each layer's native batched storage, where left pads are
stored and quantized with the real tokens (a warning says so); :meth:`ModelRunner.generate_batch`
keeps every sequence exactly as alone (:mod:`kvbench.cache.batch`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kvbench.cache.attention import ATTN_IMPLEMENTATION, register_attention, use_kvbench_attention
from kvbench.cache.cache import ATTENTION_KWARG, KVBenchCache

# The keywords under which transformers 5.24 takes a cache (``past_key_values`` is deprecated, and
# renamed to ``cache`` by the model's forward, after the hook has run).
CACHE_KWARGS = ("cache", "past_key_values")
# Set on a prepared model: the handles of its two hooks.
HOOKS_ATTR = "_kvbench_generate_hooks"


class _Forwards:
    """The forwards in flight on one model whose keyword a hook added: ``(cache, input_ids)``,
    innermost last (a forward may run inside another: a probe, a method's own forward)."""

    def __init__(self):
        self.stack: list[tuple[KVBenchCache, torch.Tensor | None] | None] = []

    def before(self, module, args, kwargs):
        cache = next((kwargs[k] for k in CACHE_KWARGS if isinstance(kwargs.get(k), KVBenchCache)), None)
        if cache is None or kwargs.get(ATTENTION_KWARG) is not None:
            # no kvbench cache, or a forward that hands it on itself (ModelRunner's)
            self.stack.append(None)
            return None
        kwargs = dict(kwargs)
        kwargs[ATTENTION_KWARG] = cache
        method = cache.method
        if method is not None and method.needs_prefill_logits() and "logits_to_keep" in kwargs:
            kwargs["logits_to_keep"] = 0
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        _warn_padded(cache, kwargs.get("attention_mask"))
        self.stack.append((cache, input_ids))
        return args, kwargs

    def after(self, module, args, kwargs, output):
        entry = self.stack.pop() if self.stack else None
        if entry is None or output is None:
            return None
        cache, input_ids = entry
        method = cache.method
        if method is None or input_ids is None:
            return None
        logits = output.logits if hasattr(output, "logits") else output[0]
        method.after_forward(cache, input_ids, logits.float())
        return None


def _warn_padded(cache: KVBenchCache, attention_mask: Any) -> None:
    """Warn once per cache when its first forward is a padded batch (pads enter the storage)."""
    if cache.get_seq_length() or getattr(cache, "_padding_checked", False):
        return
    cache._padding_checked = True
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and not bool(attention_mask.all())
    ):
        warnings.warn(
            "a padded batch over one kvbench cache: the left pads are stored (and quantized, in the "
            "same groups as the real tokens) by the method's batched storage; "
            "kvbench.generate.ModelRunner.generate_batch keeps every sequence as it is alone",
            stacklevel=3,
        )


def is_prepared(model: torch.nn.Module) -> bool:
    return getattr(model, HOOKS_ATTR, None) is not None


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` to kvbench's attention (where it is not yet) and install the hooks (once);
    returns the same model. Idempotent."""
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        use_kvbench_attention(model)
    if not is_prepared(model):
        forwards = _Forwards()
        handles = (
            model.register_forward_pre_hook(forwards.before, with_kwargs=True),
            model.register_forward_hook(forwards.after, with_kwargs=True, always_call=True),
        )
        setattr(model, HOOKS_ATTR, handles)
    return model


def unprepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Remove the hooks :func:`prepare_model` installed (the attention implementation stays)."""
    handles = getattr(model, HOOKS_ATTR, None)
    if handles is not None:
        for handle in handles:
            handle.remove()
        setattr(model, HOOKS_ATTR, None)
    return model
