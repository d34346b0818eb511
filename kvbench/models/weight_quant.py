"""Weight fake-quantization of a loaded model: round-to-nearest (RTN), per output row, over groups of
input channels, the baseline of the weight-only quantization papers (GPTQ, AWQ and OmniQuant report
RTN beside themselves; IntactKV's Table 1 improves each of them).

The option is ``model.weight_quant: {bits: B, group_size: G}`` (null, the default: weights as
loaded). After the model loads, every ``nn.Linear`` inside the transformer blocks (the attention's
q/k/v/o projections and the MLP's gate/up/down projections) has its weight ``W [out, in]``
replaced by its fake-quantized value; the embeddings and the LM head stay as loaded, as in the RTN
baselines of those papers. Each row of ``W`` is cut into ``in / G`` groups of ``G`` consecutive
input channels, and each group ``w`` is quantized asymmetrically over its own min-max range:

    scale = (max(w) - min(w)) / (2^B - 1)
    zero  = round(-min(w) / scale)
    q     = clamp(round(w / scale) + zero, 0, 2^B - 1)
    w'    = (q - zero) * scale

A constant group (``max == min``) has no range to quantize and is kept as it is (its ``w'`` equals
``w``). The arithmetic runs in float32 and ``w'`` is stored back in the weight's dtype: the model
computes with ``w'`` exactly as a dequantize-then-matmul kernel would (fake quantization: the bytes
held stay those of the loaded dtype; nothing here saves memory).

The weights as loaded are kept beside the quantized ones (:class:`LoadedWeights`, found with
:func:`loaded_weights`): a method that needs the full-precision model next to the quantized one
(IntactKV as its paper runs it: the pivot tokens' KV computed by the full-precision model,
:mod:`kvbench.methods.intactkv`) swaps them in for one forward and back. This holds the block
linears twice (135M model: about 0.4 GB more in float32; a 7-8B model: its block weights again, on
their device); nothing reads the kept copy unless a method asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvbench.errors import ConfigError

# The bit widths RTN is defined for here: 2^B - 1 levels above zero, at most 8 bits.
BITS = range(2, 9)
# The keys of ``model.weight_quant``.
KEYS = ("bits", "group_size")


def check_weight_quant(value: object) -> None:
    """``model.weight_quant``: null, or ``{bits: 2..8, group_size: positive integer}``; a ConfigError
    naming the key, the value and what is allowed otherwise. Whether ``group_size`` divides every
    layer's input width is checked on the weights (:func:`fake_quantize_model`)."""
    if value is None:
        return
    allowed = "null, or {bits: 2..8, group_size: N} (RTN weight fake-quantization)"
    check_rtn_option("model.weight_quant", value, KEYS, allowed)
    group = value["group_size"]
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ConfigError(
            "model.weight_quant.group_size",
            group,
            "a positive integer that divides every layer's input width",
        )


def check_rtn_option(key: str, value: object, keys: tuple[str, ...], allowed: str) -> None:
    """The checks ``model.weight_quant`` and ``model.act_quant`` share: ``value`` (not null) is a dict
    of exactly ``keys`` (``allowed`` says what the option takes) whose ``bits`` is an integer in
    :data:`BITS`; a ConfigError naming the key, the value and what is allowed otherwise."""
    if not isinstance(value, dict):
        raise ConfigError(key, value, allowed)
    for name in value:
        if name not in keys:
            raise ConfigError(f"{key}.{name}", value[name], f"unknown key; allowed: {', '.join(keys)}")
    missing = [k for k in keys if k not in value]
    if missing:
        also = " as well" if len(keys) > 1 else ""
        raise ConfigError(key, value, f"needs {' and '.join(missing)}{also}")
    bits = value["bits"]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ConfigError(f"{key}.bits", bits, f"an integer from {BITS.start} to {BITS.stop - 1}")


def weight_quant_tag(value: dict[str, int]) -> str:
    """What the option adds to the model's name: ``rtn-w4g64`` for 4 bits in groups of 64."""
    return f"rtn-w{value['bits']}g{value['group_size']}"


@torch.no_grad()
def rtn_fake_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``weight [out, in]`` through RTN (the module docstring's equations) over groups of
    ``group_size`` input channels per output row; same shape and dtype. ``group_size`` must divide
    ``in``."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    return rtn_last_axis(w, bits).reshape(out_features, in_features).to(weight.dtype)


def rtn_last_axis(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The module docstring's RTN of float32 ``w [..., n]``, each row of the last axis over its own
    min-max range (a constant row kept as it is); float32, same shape. The weights' groups and the
    activations' tokens (:mod:`kvbench.models.act_quant`) are such rows."""
    top = float(2**bits - 1)
    lo = w.amin(dim=-1, keepdim=True)
    hi = w.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / top
    flat = scale == 0
    safe = torch.where(flat, torch.ones_like(scale), scale)
    zero = torch.round(-lo / safe)
    q = torch.clamp(torch.round(w / safe) + zero, 0, top)
    return torch.where(flat, w, (q - zero) * safe)


def block_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The ``nn.Linear`` modules of the transformer blocks: those under the decoder's layer list
    (``model.layers.<i>.``, ``transformer.h.<i>.`` and the like: a module list whose children are
    the blocks). The embeddings and the LM head lie outside it."""
    blocks = _block_list(model)
    found = []
    for index, block in enumerate(blocks):
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear):
                found.append((f"{index}.{name}", module))
    return found


def _block_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The largest ``nn.ModuleList`` in the model: its decoder blocks."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ConfigError(
            "model.weight_quant", None, f"{type(model).__name__} has no list of decoder blocks to quantize"
        )
    return max(lists, key=len)


# The attribute of a fake-quantized model that holds its weights as loaded (a LoadedWeights).
LOADED_WEIGHTS_ATTR = "_kvbench_loaded_weights"


class LoadedWeights:
    """The block linears :func:`fake_quantize_model` quantized, each with its weight as loaded
    (a copy, on the weight's device, in its dtype)."""

    def __init__(self, kept: list[tuple[torch.nn.Linear, torch.Tensor]]):
        self.kept = kept
        # the model's activation fake-quantization (kvbench.models.act_quant.ActivationQuant), if any
        self.activations = None

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside: the model as loaded. Every quantized linear computes with its weight as loaded
        (the parameter's data is pointed at the kept copy; nothing is copied), and the activation
        fake-quantization (``model.act_quant``), if any, is paused. On leaving, by any exit, each
        parameter points at its quantized data again and the activations are quantized again, so
        the model outside is exactly the quantized one."""
        swapped: list[tuple[torch.nn.Linear, torch.Tensor]] = []
        paused = self.activations.paused() if self.activations is not None else contextlib.nullcontext()
        try:
            with paused:
                for module, original in self.kept:
                    swapped.append((module, module.weight.data))
                    module.weight.data = original
                yield
        finally:
            for module, quantized in swapped:
                module.weight.data = quantized


def loaded_weights(model: torch.nn.Module) -> LoadedWeights | None:
    """The weights as loaded of a model that :func:`fake_quantize_model` quantized (or whose
    activations :func:`kvbench.models.act_quant.fake_quantize_activations` quantized); None for a
    model as loaded (neither ``model.weight_quant`` nor ``model.act_quant``)."""
    return getattr(model, LOADED_WEIGHTS_ATTR, None)


@torch.no_grad()
def fake_quantize_model(model: torch.nn.Module, value: dict[str, int] | None) -> int:
    """Replace every block linear's weight of ``model`` by its RTN value (``value``: the checked
    ``model.weight_quant``; None does nothing). Every layer's input width is checked against
    ``group_size`` before any weight changes. The weights as loaded are kept on the model
    (:func:`loaded_weights`). Returns the number of layers quantized."""
    if value is None:
        return 0
    bits, group = value["bits"], value["group_size"]
    linears = block_linears(model)
    widths = sorted({m.in_features for _, m in linears})
    bad = [w for w in widths if w % group]
    if bad:
        fits = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths)]
        raise ConfigError(
            "model.weight_quant.group_size",
            group,
            f"a divisor of every block linear's input width ({', '.join(map(str, widths))}); "
            f"{', '.join(map(str, bad))} is not divisible by it"
            + (f" (e.g. {', '.join(map(str, fits))})" if fits else ""),
        )
    kept = []
    for _, module in linears:
        kept.append((module, module.weight.detach().clone()))
        module.weight.copy_(rtn_fake_quantize(module.weight, bits, group))
    setattr(model, LOADED_WEIGHTS_ATTR, LoadedWeights(kept))
    return len(linears)
