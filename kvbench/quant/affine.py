"""Affine (asymmetric uniform) quantization with any level count from 2 to 256.

A group of values is mapped to integer codes ``q`` in ``[0, L - 1]`` with one scale ``s`` and one
zero point ``z`` per group, and reconstructed as ``q * s + z``. Level counts need not be powers of
two: ``L = 3`` is "1.585 bits", ``L = 5`` is "2.322 bits" (see :func:`levels_for_bits`).

Rounding is round-half-up, ``floor(y + 0.5)``, rather than torch's round-half-to-even: it is
deterministic and a kernel can reproduce it with one ``floor``.

The grouped layouts follow KIVI: keys are quantized per channel (groups of consecutive tokens share
one scale per channel) and values per token (groups of consecutive channels share one scale per
token). Tensors are ``[..., T, D]`` (tokens, channels), e.g. ``[B, H_kv, T, D]``.
"""

from __future__ import annotations

import math

import torch

from kvbench.errors import ConfigError
from kvbench.quant.levels import MAX_LEVELS, MIN_LEVELS, check_levels, names_bits

ZERO_POINTS = ("minmax", "specache")
AXES = ("token", "channel")


def levels_for_bits(bits: float, key: str = "bits") -> int:
    """Level count ``L`` for a bit width ``bits = log2(L)``.

    Raises ConfigError (naming ``key``) unless ``bits`` is within
    :data:`~kvbench.quant.levels.BITS_TOLERANCE` (0.005) of ``log2(L)`` for an integer ``L`` in 2..256.
    """
    allowed = (
        f"allowed values are log2(L) for an integer level count L in {MIN_LEVELS}..{MAX_LEVELS} "
        "(e.g. 1, 1.585, 2, 2.322, 2.585, 3, 4, 8)"
    )
    try:
        bits_f = float(bits)
    except (TypeError, ValueError):
        raise ConfigError(key, bits, allowed) from None
    # Bound before exponentiating so that huge or non-finite inputs cannot overflow.
    if not math.isfinite(bits_f) or not 0.5 <= bits_f <= 8.5:
        raise ConfigError(key, bits, allowed)
    levels = round(2.0**bits_f)
    if not MIN_LEVELS <= levels <= MAX_LEVELS or not names_bits(bits_f, levels):
        raise ConfigError(key, bits, allowed)
    return levels


def bits_for_levels(levels: int) -> float:
    """Bit width ``log2(levels)`` of a level count (information content, not storage cost)."""
    check_levels(levels)
    return math.log2(levels)


def zero_point_for(choice: str, levels: int) -> str:
    """The zero point a store of ``levels`` codes uses when the user chose ``choice``: SpeCache's is
    defined for 1-bit codes only, so at more levels it falls back to KIVI's min/max."""
    return "specache" if choice == "specache" and levels == 2 else "minmax"


def affine_params(
    x: torch.Tensor, levels: int, zero_point: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group, the groups being the last axis of ``x``.

    Args:
        x: ``[..., G]``; each row of ``G`` values is one group.
        levels: level count ``L``.
        zero_point: ``"minmax"`` (KIVI): ``z = min``, ``s = (max - min) / (L - 1)``, so the grid spans
            exactly ``[min, max]``. ``"specache"`` (SpeCache, 1-bit only): ``z = (3 min + max) / 4``,
            ``s = (max - min) / 2``, so the two levels are the centres of the lower and upper halves
            of ``[min, max]`` and the threshold is the midpoint.

    Returns:
        ``(scale, zero)``, each float32 ``[..., 1]``.
    """
    check_levels(levels)
    if zero_point not in ZERO_POINTS:
        raise ConfigError("zero_point", zero_point, "one of " + ", ".join(ZERO_POINTS))
    if zero_point == "specache" and levels != 2:
        raise ConfigError("zero_point", zero_point, f"specache needs levels=2 (1 bit), got levels={levels}")
    x = x.float()
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    if zero_point == "minmax":
        # Divide by a tensor, not a Python number: on CUDA, torch turns ``tensor / number`` into a
        # multiplication by the number's float32 reciprocal, which differs from the division in the
        # last bit (then in the float16 scale) for L - 1 = 7, 15, 63; a tensor divisor keeps the
        # IEEE division the CPU and the Triton kernels do, so the reference is one on every device.
        return (hi - lo) / torch.full_like(hi, levels - 1), lo  # made on the device: no host copy
    return (hi - lo) / 2, (3 * lo + hi) / 4


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes ``q = clamp(floor((x - z) / s + 0.5), 0, L - 1)`` (round half up), as uint8.

    ``scale`` and ``zero`` broadcast against ``x``. Where ``s == 0`` (a constant group) the code is 0,
    so :func:`dequantize` returns ``z`` exactly; no NaN or inf is produced. Arithmetic is float32.

    Args:
        x: ``[..., G]`` (any float dtype).
        scale, zero: broadcastable to ``x``, e.g. ``[..., 1]``.
        levels: level count ``L``.

    Returns:
        uint8 codes, shape of ``x`` broadcast with the parameters.
    """
    check_levels(levels)
    x, scale, zero = x.float(), scale.float(), zero.float()
    flat = scale == 0
    # Divide by 1 where s == 0 so the discarded branch of the where cannot make NaN/inf.
    y = (x - zero) / torch.where(flat, torch.ones_like(scale), scale)
    q = torch.floor(y + 0.5).clamp_(0, levels - 1)
    q = torch.where(flat, torch.zeros_like(q), q)
    return q.to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Reconstruction ``codes * s + z`` in float32; ``scale``/``zero`` broadcast against ``codes``."""
    return codes.float() * scale.float() + zero.float()


def _group_size(n: int, group_size: int | None) -> int:
    if group_size is None:
        # Whole axis; 1 for an empty axis so that reshapes stay well defined.
        return max(n, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    return group_size


def _to_groups(x: torch.Tensor, axis: str, group_size: int | None) -> torch.Tensor:
    """View ``x: [..., T, D]`` with each quantization group on the last axis.

    Returns ``[..., T, D // G, G]`` for ``axis="token"`` and ``[..., T // G, D, G]`` for
    ``axis="channel"``.
    """
    if axis not in AXES:
        raise ConfigError("axis", axis, "one of " + ", ".join(AXES))
    if x.dim() < 2:
        raise ValueError(f"expected a tensor [..., T, D], got shape {tuple(x.shape)}")
    *lead, t, d = x.shape
    if axis == "token":
        g = _group_size(d, group_size)
        if d % g:
            raise ValueError(f"head dim D={d} is not a multiple of group_size={g} (axis=token)")
        return x.reshape(*lead, t, d // g, g)
    g = _group_size(t, group_size)
    if t % g:
        raise ValueError(f"token count T={t} is not a multiple of group_size={g} (axis=channel)")
    return x.reshape(*lead, t // g, g, d).transpose(-1, -2)


def _from_groups(xg: torch.Tensor, axis: str) -> torch.Tensor:
    """Inverse of :func:`_to_groups`, back to ``[..., T, D]``."""
    if axis == "token":
        return xg.flatten(-2)
    return xg.transpose(-1, -2).flatten(-3, -2)


# How the affine map's arithmetic is carried out (``quantize_grouped(..., arithmetic=)``):
#
# - ``fp32`` (kvbench's own): min, max, scale and codes in float32, round half up
#   (``floor(y + 0.5)``), scale and zero rounded to ``param_dtype`` (fp16) *before* the codes are
#   computed against them, so the stored parameters reconstruct exactly what was quantized.
# - ``kivi`` (KIVI's released code, its ``quant_and_pack_kcache``/``_vcache`` arithmetic):
#   everything in the input's dtype: ``s = (max - min) / (L - 1)``, then ``(x - min) / s``, clamped
#   to ``[0, L - 1]`` and rounded half to even (``torch.round``); scale and minimum stored in the
#   input's dtype (fp16 in, fp16 out; fp32 in, fp32 out). One deliberate difference: a constant group
#   (max = min) divides 0 by 0 there; here it gets code 0, scale 0 and its exact minimum, as in
#   ``fp32``.
ARITHMETICS = ("fp32", "kivi")


def quantize_grouped(
    x: torch.Tensor,
    levels: int,
    axis: str,
    group_size: int | None,
    zero_point: str = "minmax",
    param_dtype: torch.dtype | None = torch.float16,
    arithmetic: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x: [..., T, D]`` in KIVI's grouped layouts.

    ``axis="token"``: each token's D channels form groups of ``G`` consecutive channels; scale/zero are
    ``[..., T, D // G]``. ``axis="channel"``: the tokens form groups of ``G`` consecutive tokens, with one
    scale/zero per (token group, channel): ``[..., T // G, D]``; T must be a multiple of G.
    ``group_size=None`` takes the whole axis (G = D, resp. G = T).

    The parameters are rounded to ``param_dtype`` (their storage dtype) before the codes are
    computed, and the codes are computed against the rounded values, so dequantizing the stored
    ``(codes, scale, zero)`` is exactly this quantizer's reconstruction.

    ``arithmetic="kivi"`` follows KIVI's released code instead (see :data:`ARITHMETICS`): the input's
    dtype throughout, round half to even, parameters returned in the input's dtype (``param_dtype``
    is ignored); only ``zero_point="minmax"`` exists there.

    Returns:
        ``(codes, scale, zero)``: codes uint8 ``[..., T, D]`` (one code per byte, unpacked), scale and
        zero in ``param_dtype`` with the shapes above.
    """
    if arithmetic not in ARITHMETICS:
        raise ConfigError("arithmetic", arithmetic, "one of " + ", ".join(ARITHMETICS))
    if arithmetic == "kivi":
        return _quantize_grouped_kivi(x, levels, axis, group_size, zero_point)
    xg = _to_groups(x, axis, group_size).float()
    scale, zero = affine_params(xg, levels, zero_point)
    scale, zero = scale.to(param_dtype), zero.to(param_dtype)
    codes = quantize(xg, scale, zero, levels)
    return _from_groups(codes, axis), scale.squeeze(-1), zero.squeeze(-1)


def _quantize_grouped_kivi(
    x: torch.Tensor, levels: int, axis: str, group_size: int | None, zero_point: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_levels(levels)
    if zero_point != "minmax":
        raise ConfigError("zero_point", zero_point, "minmax (KIVI's released arithmetic has no other)")
    if not x.is_floating_point():
        raise ValueError(f"expected a float tensor, got {x.dtype}")
    xg = _to_groups(x, axis, group_size)
    lo = xg.amin(dim=-1, keepdim=True)
    hi = xg.amax(dim=-1, keepdim=True)
    scale = (hi - lo) / (levels - 1)  # in x's dtype, rounded once, as the released code does
    flat = scale == 0
    y = (xg - lo) / torch.where(flat, torch.ones_like(scale), scale)
    q = torch.round(y.clamp(0, levels - 1))  # clamp, then round half to even
    q = torch.where(flat, torch.zeros_like(q), q)
    return _from_groups(q.to(torch.uint8), axis), scale.squeeze(-1), lo.squeeze(-1)


def dequantize_grouped(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    axis: str,
    group_size: int | None,
) -> torch.Tensor:
    """Float32 reconstruction ``[..., T, D]`` from :func:`quantize_grouped`'s outputs.

    Args:
        codes: ``[..., T, D]`` uint8 (unpacked).
        scale, zero: ``[..., T, D // G]`` (token axis) or ``[..., T // G, D]`` (channel axis).
        axis, group_size: as given to :func:`quantize_grouped`.
    """
    cg = _to_groups(codes, axis, group_size)
    expected = cg.shape[:-1]
    if scale.shape != expected or zero.shape != expected:
        raise ValueError(
            f"scale/zero shapes {tuple(scale.shape)}/{tuple(zero.shape)} do not match codes "
            f"{tuple(codes.shape)} with axis={axis}, group_size={group_size}: expected {tuple(expected)}"
        )
    return _from_groups(dequantize(cg, scale.unsqueeze(-1), zero.unsqueeze(-1)), axis)


def fake_quantize_grouped(
    x: torch.Tensor,
    levels: int,
    axis: str,
    group_size: int | None,
    zero_point: str = "minmax",
    param_dtype: torch.dtype | None = torch.float16,
    arithmetic: str = "fp32",
) -> torch.Tensor:
    """Quantize then dequantize: float32 ``[..., T, D]``, what attention would see from the cache.

    No cache calls it (the stores keep the codes and dequantize on read): it is the reference the
    method, task and kernel tests compare the stores' reads with, kept beside the two functions it
    composes so that a change to either changes the reference with it."""
    codes, scale, zero = quantize_grouped(x, levels, axis, group_size, zero_point, param_dtype, arithmetic)
    return dequantize_grouped(codes, scale, zero, axis, group_size)
