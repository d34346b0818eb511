"""Activation fake-quantization of a loaded model: round-to-nearest (RTN), per token, of the input of
every linear layer :mod:`kvbench.models.weight_quant` quantizes, the activation half of the
weight-activation (W-A) setting of the quantization papers (OmniQuant and QuaRot at W4A4, where
IntactKV's Table 6 improves each; RTN is the baseline both report beside themselves).

The option is ``model.act_quant: {bits: A}`` (null, the default: activations as computed). After
the model loads, every ``nn.Linear`` inside the transformer blocks (the attention's q/k/v/o
projections and the MLP's gate/up/down projections; :func:`~kvbench.models.weight_quant.block_linears`)
gets a forward pre-hook that replaces its input ``x [..., in]`` by its fake-quantized value, each
token's row ``x_t`` (all ``in`` channels, one range per token) quantized asymmetrically over its own
min-max range:

    scale = (max(x_t) - min(x_t)) / (2^A - 1)
    zero  = round(-min(x_t) / scale)
    q     = clamp(round(x_t / scale) + zero, 0, 2^A - 1)
    x_t'  = (q - zero) * scale

the equations of the weights' RTN (:mod:`kvbench.models.weight_quant`) with a token's row as the
group. A constant row (``max == min``) is kept as it is. The arithmetic runs in float32 and ``x'``
goes back in the input's dtype; the linear computes with it as a dequantize-then-matmul kernel
would (fake quantization). The embeddings, the norms, attention (its softmax and the KV cache,
which the run's method stores) and the LM head stay as computed.

The hooks stay on the model; :meth:`ActivationQuant.paused` switches them off for one forward.
:class:`~kvbench.models.weight_quant.LoadedWeights` (the full-precision model a method swaps in,
IntactKV's ``pivot: full_precision``) holds the model's :class:`ActivationQuant` and pauses it
while the weights as loaded are in, so that forward is the model as loaded: weights and
activations unquantized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvbench.models.weight_quant import (
    LOADED_WEIGHTS_ATTR,
    LoadedWeights,
    block_linears,
    check_rtn_option,
    loaded_weights,
    rtn_last_axis,
)

# The keys of ``model.act_quant``.
KEYS = ("bits",)


def check_act_quant(value: object) -> None:
    """``model.act_quant``: null, or ``{bits: 2..8}``; a ConfigError naming the key, the value and
    what is allowed otherwise."""
    if value is None:
        return
    check_rtn_option(
        "model.act_quant", value, KEYS, "null, or {bits: 2..8} (per-token RTN activation fake-quantization)"
    )


def act_quant_tag(value: dict[str, int]) -> str:
    """What the option adds to the model's name after the weights' tag: ``a8`` for 8 bits."""
    return f"a{value['bits']}"


@torch.no_grad()
def rtn_fake_quantize_tokens(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [..., C]`` through per-token RTN (the module docstring's equations): each row of the
    last axis over its own min-max range; same shape and dtype."""
    return rtn_last_axis(x.detach().to(torch.float32), bits).to(x.dtype)


class ActivationQuant:
    """The pre-hooks that quantize the inputs of a model's block linears to ``bits``; on while
    :attr:`enabled`."""

    def __init__(self, bits: int):
        self.bits = bits
        self.enabled = True
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def hook(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if not self.enabled or not args:
            return None
        return (rtn_fake_quantize_tokens(args[0], self.bits), *args[1:])

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside: the inputs pass unquantized; on leaving, by any exit, as they were before."""
        before = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = before

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def activation_quant(model: torch.nn.Module) -> ActivationQuant | None:
    """The activation quantization :func:`fake_quantize_activations` put on ``model``; None for a
    model without ``model.act_quant``."""
    weights = loaded_weights(model)
    return None if weights is None else weights.activations


def fake_quantize_activations(model: torch.nn.Module, value: dict[str, int] | None) -> int:
    """Hook per-token RTN onto the input of every block linear of ``model`` (``value``: the checked
    ``model.act_quant``; None does nothing). The model's :class:`LoadedWeights` (made here, with no
    weights, if ``model.weight_quant`` left none) holds the hooks, so its full-precision swap
    pauses them. Returns the number of layers hooked."""
    if value is None:
        return 0
    weights = loaded_weights(model)
    if weights is None:
        weights = LoadedWeights([])
        setattr(model, LOADED_WEIGHTS_ATTR, weights)
    if weights.activations is not None:
        raise ValueError("the model's activations are already quantized")
    quant = ActivationQuant(value["bits"])
    linears = block_linears(model)
    for _, module in linears:
        quant.handles.append(module.register_forward_pre_hook(quant.hook))
    weights.activations = quant
    return len(linears)
