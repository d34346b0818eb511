"""kvbench's Python API: a method's cache in your own transformers code.

::

    model, tokenizer = kvbench.load("smollm2-135m")       # or kvbench.prepare(your_model)
    cache = kvbench.new_cache(model, "kivi", bits=2)       # one request's cache
    out = model.generate(ids, cache=cache, max_new_tokens=32)
    cache.memory_report().effective_bits                    # measured from the tensors it holds

- :func:`prepare`: a loaded transformers model switched to kvbench's attention, with the forward
  hooks that hand a kvbench cache to it wherever transformers takes a cache (``generate()``,
  pipelines, ``model(ids, cache=...)``; the mechanism and why in :mod:`kvbench.cache.hf`).
- :func:`new_cache`: a fresh cache of a registered method for one request. Its arguments are the
  command line's: ``bits`` is the top-level ``bits`` (a level count where fractional), the other
  keywords are the method node's keys (``method.group_size=64`` on the command line is
  ``group_size=64`` here), validated by the same code (the method's config dataclass, then the
  method's checks against the model), so a mistake is the same one line
  (:class:`~kvbench.errors.ConfigError`: key, value, what is allowed). The cache is a
  :class:`~kvbench.cache.cache.KVBenchCache`; its :meth:`~kvbench.cache.cache.KVBenchCache.memory_report`
  is the accounting every run records.
- :func:`unprepare`: the hooks removed and the kept methods released.
- :func:`load`: a model of ``conf/model`` (or a ``model`` node) loaded as kvbench's runs load it
  (:func:`kvbench.builder.load_for_methods`), prepared.

A cache serves one request (one ``generate()`` call, its prompt and what it generates); make a new
one for the next. Greedy decoding over it gives :meth:`kvbench.generate.ModelRunner.generate`'s
tokens.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvbench.cache import KVBenchCache
from kvbench.cache.hf import prepare_model
from kvbench.cache.reach import check_cache_reached
from kvbench.errors import ConfigError


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a transformers causal LM, loaded anyhow) ready for kvbench caches: kvbench's
    attention implementation set, the forward hooks of :mod:`kvbench.cache.hf` installed, and a probe
    forward that checks the installed transformers hands the cache to every layer
    (:func:`kvbench.cache.reach.check_cache_reached`; one line if not). Returns the same model;
    calling it again does nothing more."""
    from kvbench.cache.hf import is_prepared
    from kvbench.models import model_shape

    if is_prepared(model):
        return model
    prepare_model(model)
    check_cache_reached(model, model_shape(model).num_layers)
    return model


# Prepared methods kept per model (newest last), so that a method's one-time preparation
# (KVQuant's calibration, SemKV's forward hooks) runs once for many requests; the oldest beyond
# KEPT_METHODS is released (Method.release detaches what it attached to the model).
KEPT_METHODS = 8
_KEPT_ATTR = "_kvbench_methods"


def new_cache(
    model: torch.nn.Module,
    method: str,
    *,
    bits: float | None = None,
    tokenizer: Any = None,
    data_root: str | Path | None = None,
    **knobs: Any,
) -> KVBenchCache:
    """A fresh cache of ``method`` for one request on ``model`` (prepared first where it is not).

    ``method``: a registered method's name (an unknown one is refused with the list);
    ``bits``: the command line's top-level ``bits`` (filled into the method's bits knob unless a
    keyword sets it; a warning where the method has none, as the CLI warns); ``knobs``: the method
    node's keys. ``tokenizer`` and ``data_root``: what a method that calibrates offline reads
    (KVQuant's calibration text); the tokenizer defaults to the one in the model's folder, where
    the model was loaded from one.

    The first call for a method and its arguments on a model builds the method, checks it against
    the model's shape and prepares it as a run does (:meth:`kvbench.builder.LoadedModel.runner`);
    later calls with the same arguments reuse it (the last :data:`KEPT_METHODS` are kept), so a
    calibration runs once. As in kvbench's runs, one method object serves one request at a time:
    finish a ``generate()`` before starting the next over a cache of the same method. The method
    is not told how many tokens the request will generate (``ModelRunner.generate`` tells
    :meth:`~kvbench.methods.Method.new_request`; only eviction at matched memory reads it, and
    plans for none here).

    Refused, in one line: a method with its own decode step (SpeCache's speculative forward), which
    ``generate()``'s loop cannot run (use :meth:`kvbench.generate.ModelRunner.generate`), and
    ``cuda_graph=True`` (the static step is that runner's too)."""
    from kvbench.results import canonical_json

    if not isinstance(method, str):
        raise ConfigError("method", method, "a registered method's name")
    if "name" in knobs:
        raise ConfigError("name", knobs["name"], f"the method is new_cache's second argument ({method!r})")
    prepare(model)
    kept: dict[str, Any] = getattr(model, _KEPT_ATTR, None) or {}
    key = canonical_json([method, bits, knobs, None if data_root is None else str(data_root), id(tokenizer)])
    runner = kept.pop(key, None)
    if runner is None:
        runner = _prepared_runner(model, method, bits, knobs, tokenizer, data_root)
    kept[key] = runner  # newest last
    while len(kept) > KEPT_METHODS:
        kept.pop(next(iter(kept))).method.release()
    setattr(model, _KEPT_ATTR, kept)
    cache = runner.new_cache()
    cache.method = runner.method
    return cache


def _prepared_runner(model, method: str, bits, knobs: dict[str, Any], tokenizer, data_root):
    """The method built from the command line's arguments, checked against ``model`` and prepared:
    a :class:`kvbench.generate.ModelRunner` whose ``new_cache`` makes the requests' caches."""
    from kvbench.builder import LoadedModel
    from kvbench.methods import Method, build_method
    from kvbench.models import model_shape
    from kvbench.spec import bits_ignored

    node = {"name": method, **knobs}
    built = build_method(node, bits=bits)
    for code, line in bits_ignored({"bits": bits, "method": node}, built).items():
        warnings.warn(f"{code}: {line}", stacklevel=3)
    if type(built).decode_step is not Method.decode_step:
        raise ConfigError(
            "method",
            method,
            f"{built.label()} runs its own decode step (Method.decode_step), which transformers' "
            "generate() loop cannot run: decode it with kvbench.generate.ModelRunner.generate",
        )
    if built.config.cuda_graph:
        raise ConfigError(
            "method.cuda_graph",
            True,
            "the static (CUDA-graph) decode step is kvbench.generate.ModelRunner.generate's; "
            "model.generate() runs the eager step (cuda_graph=False)",
        )
    if tokenizer is None and type(built).prepare is not Method.prepare:
        tokenizer = _folder_tokenizer(model)  # only a method that prepares itself reads it
    shape = model_shape(model)
    # the runner reads the tokenizer's EOS only for its own generate loop, which this cache skips
    loaded = LoadedModel(None, model, tokenizer or SimpleNamespace(eos_token_id=None), shape, 0.0)
    return loaded.runner(built, data_root)


def unprepare(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`prepare` but for the attention implementation: the forward hooks removed, the
    methods kept for :func:`new_cache` released (:meth:`~kvbench.methods.Method.release`). Returns
    the same model."""
    from kvbench.cache.hf import unprepare_model

    for runner in (getattr(model, _KEPT_ATTR, None) or {}).values():
        runner.method.release()
    setattr(model, _KEPT_ATTR, None)
    return unprepare_model(model)


def load(model: str | dict[str, Any] = "smollm2-135m", device: str = "auto") -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)``: a ``conf/model`` name or a ``model`` node (``{"path": folder}``,
    ``{"hub_id": ...}``, with ``dtype``...) loaded as kvbench's runs load it, on ``device``
    (``auto``: CUDA where visible), and prepared (:func:`prepare`)."""
    from kvbench.builder import load_for_methods

    loaded = load_for_methods(model, device)
    return prepare(loaded.model), loaded.tokenizer


def _folder_tokenizer(model: torch.nn.Module) -> Any:
    """The tokenizer in the folder the model was loaded from, or None."""
    folder = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None
