"""The attention geometry of a model, read from its transformers config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.quant.rope import RoPESpec, rope_specs


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
    )


def _rope_theta(config: Any) -> float | None:
    """transformers 5 keeps rope_theta inside ``rope_parameters``; older configs have it at top level."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None
