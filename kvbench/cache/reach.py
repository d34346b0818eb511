"""Whether a model's forward reaches kvbench's cache: a one-time probe at model load.

kvbench hands its cache to a forward as transformers' ``cache=`` keyword and to the attention
function as :data:`~kvbench.cache.cache.ATTENTION_KWARG` (the contract in :mod:`kvbench.cache.cache`).
A transformers release that names the cache keyword differently (5.17 takes ``past_key_values``)
swallows ``cache=`` into its ``**kwargs`` without a word, builds a cache of its own, and every
attention call falls back to plain SDPA over the forward's own tokens: the method's cache stays
empty and every number measured through it is the uncompressed model's, or garbage in decode.

:func:`check_cache_reached` runs one forward of a few tokens over a probe cache (one plain
full-precision layer per transformer layer) and raises :class:`CacheNotReachedError`, one line
naming the transformers version and the supported range, unless the cache stored every token in
every layer and the attention function read at least one layer through it. The builder calls it
once per loaded model (:func:`kvbench.builder.load_for_methods`); it costs one forward of
:data:`PROBE_TOKENS` tokens.
"""

from __future__ import annotations

import torch

from kvbench.cache.cache import KVBenchCache
from kvbench.cache.layer import KVLayer
from kvbench.errors import ConfigError

# The transformers releases kvbench is tested with (pyproject.toml's pin; tests/cache/test_reach.py
# checks that the two agree).
SUPPORTED_TRANSFORMERS = ">=5.24,<5.25"
PROBE_TOKENS = 3


class CacheNotReachedError(ConfigError):
    """The installed transformers does not hand kvbench's cache to the model's layers."""


class _ProbeLayer(KVLayer):
    """Holds what it is given in full precision and counts the attention calls that reach it."""

    def __init__(self, layer_idx: int):
        super().__init__(layer_idx)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.attended = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=-2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=-2)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {
            "keys": [t for t in (self.keys,) if t is not None],
            "values": [t for t in (self.values,) if t is not None],
        }

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        self.attended += 1
        return super().attend(module, query, keys, values, attention_mask, **kwargs)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _input_device(model: torch.nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def probe(model: torch.nn.Module, num_layers: int, tokens: int = PROBE_TOKENS) -> tuple[list[int], list[int]]:
    """One forward of ``tokens`` token ids over a probe cache of ``num_layers`` layers: the tokens
    each layer stored and the attention calls that read each layer through the cache."""
    cache = KVBenchCache([_ProbeLayer(i) for i in range(num_layers)])
    ids = torch.zeros(1, tokens, dtype=torch.long, device=_input_device(model))
    with torch.no_grad():
        model(input_ids=ids, **cache.forward_kwargs())
    return [layer.num_tokens for layer in cache.layers], [layer.attended for layer in cache.layers]


def check_cache_reached(model: torch.nn.Module, num_layers: int, tokens: int = PROBE_TOKENS) -> None:
    """Raise :class:`CacheNotReachedError` unless a forward of ``model`` over a kvbench cache of
    ``num_layers`` layers stores all ``tokens`` in every layer and its attention reads the cache
    (in at least one layer: a model that shares keys across layers attends some of them as given)."""
    stored, attended = probe(model, num_layers, tokens)
    reached = all(n == tokens for n in stored) and any(attended)
    if reached:
        return
    name = type(model).__name__
    raise CacheNotReachedError(
        "transformers",
        transformers_version(),
        f"kvbench's cache was not reached by {name}'s forward (a probe of {tokens} tokens stored "
        f"{min(stored, default=0)}-{max(stored, default=0)} of them per layer, attention read the "
        f"cache in {sum(1 for a in attended if a)} of {num_layers} layers); kvbench supports "
        f"transformers{SUPPORTED_TRANSFORMERS}: install a release in that range",
    )
