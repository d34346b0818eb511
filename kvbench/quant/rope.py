"""Rotary position embedding (RoPE) and its exact inverse, for pre-RoPE key storage.

Convention of transformers' Llama (the "rotate half" layout): channel ``j < d/2`` pairs with channel
``j + d/2``, both turned by the angle ``p * w_j`` of the token position ``p``, with

    RoPE(x, p) = x * cos(p w) + rotate_half(x) * sin(p w),   rotate_half([a, b]) = [-b, a]

where ``cos``/``sin`` repeat the d/2 angles twice. The inverse is the rotation by the opposite
angle, ``x * cos(p w) - rotate_half(x) * sin(p w)``. Angles are computed in float32 exactly as
transformers computes them (``p * inv_freq`` in float32), so inverting the model's own rotation is
exact up to float32 rounding.

The inverse frequencies ``w`` depend on the layer's RoPE type (:class:`RoPESpec`, built from a
transformers config by :func:`rope_specs`):

- ``default``: ``w_j = theta^(-2j/d)`` (:func:`inv_freq`), the same numbers for one ``theta`` as
  before per-layer specs existed;
- every other type: transformers' own ``ROPE_INIT_FUNCTIONS[rope_type]`` (``linear`` divides ``w``
  by the factor, ``llama3`` rescales the low frequencies, ``yarn``/``longrope`` also return an
  ``attention_scaling`` that multiplies cos and sin), evaluated at load time;
- per-layer-type parameters (Gemma-3: ``config.rope_parameters`` keyed by ``config.layer_types``,
  e.g. ``sliding_attention`` with theta 1e4 and ``full_attention`` with theta 1e6 and linear
  scaling) give each layer the frequencies of its own type.

Pre-RoPE keys (KVQuant) need a rotation that is the same at every step: the static types
:data:`PRE_ROPE_TYPES` over the full head dim with ``attention_scaling == 1``.
:meth:`RoPESpec.pre_rope_problem` says why any other layer cannot be undone (``dynamic`` and
``longrope`` change ``w`` with the running sequence length; ``yarn`` scales cos/sin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PRE_ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE types whose rotation pre-RoPE keys can undo: fixed frequencies, cos/sin not rescaled."""


def inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[dim / 2]``: ``theta^(-2j/dim)`` (default-type RoPE)."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (float(theta) ** exponents)


@dataclass(frozen=True)
class RoPESpec:
    """One layer's rotary embedding, as transformers computes it for that layer.

    ``inv_freq``: the float32 inverse frequencies ``[dim / 2]`` (held as Python floats so the
    spec is hashable; each converts back to the same float32), None when they could not be computed
    (``problem`` says why). ``attention_scaling`` multiplies cos and sin (1 for the static types).
    A partial rotation (``partial_rotary_factor < 1``) has fewer than ``head_dim / 2`` frequencies.
    ``layer_type``: the key of per-layer-type parameters the spec came from (None: one set for all).
    """

    rope_type: str
    inv_freq: tuple[float, ...] | None
    head_dim: int
    attention_scaling: float = 1.0
    layer_type: str | None = None
    problem: str | None = None

    @classmethod
    def default(cls, head_dim: int, theta: float, layer_type: str | None = None) -> RoPESpec:
        """Default-type RoPE with base ``theta`` over the whole head."""
        return cls("default", tuple(inv_freq(head_dim, theta).tolist()), head_dim, layer_type=layer_type)

    @property
    def dim(self) -> int:
        """Channels turned: ``2 * len(inv_freq)`` (the head dim unless the rotation is partial)."""
        return self.head_dim if self.inv_freq is None else 2 * len(self.inv_freq)

    def frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 ``[dim / 2]`` inverse frequencies."""
        if self.inv_freq is None:
            raise ValueError(f"rope_type={self.rope_type!r}: no frequencies ({self.problem})")
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)

    def pre_rope_problem(self) -> str | None:
        """Why keys rotated by this layer cannot be stored before RoPE (None: they can)."""
        if self.rope_type not in PRE_ROPE_TYPES:
            return f"uses rope_type={self.rope_type!r}, which pre-RoPE keys cannot undo"
        if self.inv_freq is None:
            return f"has rope_type={self.rope_type!r} parameters kvbench could not read ({self.problem})"
        if self.dim != self.head_dim:
            return f"turns {self.dim} of its {self.head_dim} key channels (partial RoPE), not supported"
        if self.attention_scaling != 1.0:
            return f"scales cos/sin by {self.attention_scaling:g}, which pre-RoPE keys cannot undo"
        return None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``, ``sin [T, dim]`` (``attention_scaling`` included) at ``positions [T]``."""
        cos, sin = angles_cos_sin(positions, self.frequencies(positions.device))
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's RoPE of ``x [..., T, head_dim]`` at ``positions [T]`` (float32); a partial
        rotation turns the first ``dim`` channels and passes the rest, as transformers' models do."""
        cos, sin = self.cos_sin(positions.to(x.device))
        if self.dim == x.shape[-1]:
            return rotate(x, cos, sin)
        xf = x.float()
        return torch.cat([rotate(xf[..., : self.dim], cos, sin), xf[..., self.dim :]], dim=-1)


def angles_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``, ``sin [T, 2 * len(freqs)]`` of the angles ``positions[t] * freqs``."""
    angles = positions.float()[:, None] * freqs.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``, ``sin`` of shape ``[T, dim]`` for integer ``positions [T]`` (default type)."""
    return angles_cos_sin(positions, inv_freq(dim, theta, positions.device))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of ``x [..., T, D]`` with precomputed ``cos``/``sin [T, D]``, float32."""
    xf = x.float()
    return xf * cos - rotate_half(xf) * sin if inverse else xf * cos + rotate_half(xf) * sin


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool) -> torch.Tensor:
    if positions.dim() != 1 or positions.shape[0] != x.shape[-2]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [T] with T = {x.shape[-2]}")
    cos, sin = cos_sin(positions.to(x.device), x.shape[-1], theta)
    return rotate(x, cos, sin, inverse)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Default-type RoPE of ``x [..., T, D]`` at ``positions [T]``, float32."""
    return _rotate(x, positions, theta, False)


def invert_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: the pre-RoPE ``x [..., T, D]``, float32."""
    return _rotate(x, positions, theta, True)


# -- RoPE specs from a transformers config ----------------------------------------------------------


def rope_specs(config: Any) -> tuple[RoPESpec | None, ...]:
    """One :class:`RoPESpec` per layer of a transformers text config (None for a layer without RoPE
    parameters; every entry None for a model without RoPE). Never raises: parameters that cannot be
    read give a spec without frequencies whose ``problem`` says why (only pre-RoPE storage needs them)."""
    num_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping) or not params:
        theta = getattr(config, "rope_theta", None)  # a config from before rope_parameters
        return (None if theta is None else RoPESpec.default(head_dim, float(theta)),) * num_layers
    layer_types: Sequence[str] = getattr(config, "layer_types", None) or ()
    nested = [key for key in params if key in set(layer_types)]
    if not nested:
        return (_spec(config, params, head_dim, None),) * num_layers
    by_type = {t: _spec(config, params[t], head_dim, t) for t in nested if params[t] is not None}
    return tuple(by_type.get(layer_types[i]) if i < len(layer_types) else None for i in range(num_layers))


def _spec(config: Any, params: Mapping, head_dim: int, layer_type: str | None) -> RoPESpec:
    rope_type = params.get("rope_type") or "default"
    try:
        if rope_type == "default":
            # what the models' own compute_default_rope_parameters do (not in ROPE_INIT_FUNCTIONS)
            dim = int(head_dim * (params.get("partial_rotary_factor") or 1.0))
            freqs, scaling = inv_freq(dim, float(params["rope_theta"])), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise KeyError(f"transformers has no rope init function for {rope_type!r}")
            freqs, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    except Exception as err:  # noqa: BLE001 - any unreadable parameters: recorded, refused where needed
        problem = f"{type(err).__name__}: {err}"
        return RoPESpec(rope_type, None, head_dim, layer_type=layer_type, problem=problem)
    freqs = tuple(freqs.detach().float().cpu().tolist())
    return RoPESpec(rope_type, freqs, head_dim, float(scaling), layer_type)


def layer_rope(shape: Any, layer_idx: int) -> RoPESpec | None:
    """The RoPE of layer ``layer_idx`` of a :class:`kvbench.models.ModelShape`: its per-layer spec
    when the shape was read from a config, else default-type RoPE from ``rope_theta`` (a shape
    built by hand), else None."""
    specs = getattr(shape, "rope", None)
    if specs is not None:
        return specs[layer_idx]
    theta = getattr(shape, "rope_theta", None)
    return None if theta is None else RoPESpec.default(shape.head_dim, theta)


def pre_rope_problem(shape: Any) -> str | None:
    """One line saying why the keys of a model of this shape cannot be stored before RoPE (None:
    every layer's rotation can be undone)."""
    specs = [layer_rope(shape, i) for i in range(shape.num_layers)]
    if all(spec is None for spec in specs):
        if getattr(shape, "rope", None) is None:
            return "the model shape reports no RoPE (neither per-layer RoPE parameters nor rope_theta)"
        return (
            "the model has no rotary position embedding (its config has no rope_parameters or "
            "rope_theta), so its keys carry no rotation to undo"
        )
    supported = ", ".join(PRE_ROPE_TYPES)
    for i, spec in enumerate(specs):
        if spec is None:
            return f"layer {i} has no RoPE parameters (no entry for its layer type in config.rope_parameters)"
        problem = spec.pre_rope_problem()
        if problem is not None:
            where = f"layer {i}" if spec.layer_type is None else f"layer {i} ({spec.layer_type})"
            return f"{where} {problem} (supported: {supported})"
    return None
