"""The attention geometry of a model, read from its transformers config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.quant.rope import RoPESpec, rope_specs

# The config layer types whose cache transformers keeps as a sliding window.
SLIDING_LAYER_TYPES = ("sliding_attention",)


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry methods need to size caches and quantizer groups."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None = None
    rope_theta: float | None = None
    # per-layer RoPE (None entries: layers without RoPE), read from the config; None for a shape built
    # by hand (then rope_theta, if any, means default-type RoPE). Derived, so left out of == and repr.
    rope: tuple[RoPESpec | None, ...] | None = field(default=None, compare=False, repr=False)
    # Sliding-window attention (Gemma-3, Mistral v0.1, Qwen2 with use_sliding_window): the attention
    # type of every layer as the config names it, and the window. Both None when every layer attends
    # in full. :meth:`sliding_layers` says which layers hold only a window.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` attends a sliding window (transformers keeps only its newest
        ``sliding_window - 1`` tokens: :class:`~transformers.cache_utils.DynamicSlidingWindowLayer`)."""
        return (
            self.layer_types is not None
            and self.sliding_window is not None
            and self.layer_types[layer_idx] in SLIDING_LAYER_TYPES
        )

    def sliding_layers(self) -> list[int]:
        """Indices of the sliding-window layers (empty for a model that attends in full everywhere)."""
        return [i for i in range(self.num_layers) if self.is_sliding(i)]


def model_shape(model: torch.nn.Module, max_context: int | None = None) -> ModelShape:
    """Read the shape from ``model.config``; ``max_context`` (a ModelConfig override) wins when given."""
    return shape_of_config(model.config, max_context)


def shape_of_config(config: Any, max_context: int | None = None) -> ModelShape:
    """:func:`model_shape` from a transformers config alone (no weights needed)."""
    config = config.get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_context=max_context or getattr(config, "max_position_embeddings", None),
        rope_theta=_rope_theta(config),
        rope=rope_specs(config),
        **_sliding(config),
    )


def _sliding(config: Any) -> dict[str, Any]:
    """``layer_types`` and ``sliding_window`` as transformers' ``DynamicCache(config=...)`` reads them
    (:func:`transformers.cache_utils.get_layer_types_and_kwargs`): the config's ``layer_types``, or,
    without them, every layer sliding when ``sliding_window`` is set (Mistral v0.1). Both None when
    no layer is sliding, so a full-attention model's shape is unchanged."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * config.num_hidden_layers
    types = tuple(str(t) for t in types)
    if window is None or not any(t in SLIDING_LAYER_TYPES for t in types):
        return {}
    return {"layer_types": types, "sliding_window": int(window)}


def _rope_theta(config: Any) -> float | None:
    """transformers 5 keeps rope_theta inside ``rope_parameters``; older configs have it at top level."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None
