"""Fused Triton quantize + pack and unpack + dequantize for the packed KV store.

Bit-identical to the torch reference: :func:`quantize_pack` equals
``pack(quantize_grouped(x, ...)[0], L)`` with the same scale/zero tensors, and
:func:`unpack_dequantize` equals ``dequantize_grouped(unpack(packed, L, D), scale, zero, ...)``
(:mod:`kvbench.quant.affine`, :mod:`kvbench.quant.packing`). Layouts are those of
:mod:`kvbench.cache.quantized`: codes packed along the channel axis D for both quantization axes;
scale/zero ``[..., T, D // G]`` for ``axis="token"`` and ``[..., T // G, D]`` for ``axis="channel"``.

Two kernels quantize. ``_params_kernel`` reduces each group to min/max and writes the rounded
scale/zero; ``_pack_kernel`` reads them back, so the codes are computed from exactly the stored
values as the reference does, and packs a tile of tokens into chunk words. Both see every group as
a row of a strided 3-D view, which makes the two axes one code path.

Exactness: every float step is the reference's, in the same order and in float32. Division is
IEEE round-to-nearest (``tl.math.div_rn``; a plain ``/`` is approximate on CUDA), and the kernels
are launched with ``enable_fp_fusion=False`` so that ``3 * lo + hi`` and ``code * s + z`` are not
contracted into an FMA (torch eager rounds the product and the sum separately). bfloat16 data is
moved as int16 bits and converted by hand, which is exact on every backend (the interpreter's own
bf16 casts truncate and mangle subnormals). Where CUDA could still differ (checked only under the
interpreter so far): float32 *subnormals* (|v| < 2**-126) may be flushed to zero by CUDA arithmetic,
which matters only for inputs that small or float32/bfloat16 parameters that small (float16
parameters are never float32-subnormal); a group whose min or max is a zero may store -0.0 where
torch stores +0.0 (equal under ``torch.equal``). Inputs must be finite: with inf/NaN the codes are
unspecified, as in the reference.

Triton is imported at module level: import this module only when :func:`require_triton` holds, and,
for the CPU interpreter, after ``TRITON_INTERPRET=1`` is set (``@triton.jit`` reads it at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.errors import ConfigError
from kvbench.kernels.runtime import interpreter_numpy_compat, interpreting, planning_cuda, require_triton
from kvbench.quant.levels import check_levels
from kvbench.quant.packing import chunk_layout, packed_length

interpreter_numpy_compat()  # triton < 3.7's interpreter under numpy >= 2.4

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# How the params kernel rounds scale/zero to their storage dtype (see _round_param).
_PARAM_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Elements per tile. On a GPU a few thousand keep the tile in registers; the interpreter runs each
# program instance as whole-array numpy ops, so there fewer, bigger instances are much faster.
_GPU_TILE = 4096
_INTERPRETER_TILE = 1 << 16


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_param(v, PARAM_KIND: tl.constexpr):
    """Round float32 ``v`` to the storage dtype and back to float32 (what ``.to(param_dtype)`` does)."""
    if PARAM_KIND == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif PARAM_KIND == 2:
        # Round-to-nearest-even into bfloat16 on the bits: the interpreter's fp32 -> bf16 cast
        # truncates, so the rounding is done here and the store that follows is exact.
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _load_f32(ptr, offs, mask, BF16_BITS: tl.constexpr):
    """Load ``ptr + offs`` (masked) as float32.

    With BF16_BITS, ``ptr`` is an int16 view of bfloat16 data, widened on the bits: exact everywhere,
    whereas the interpreter's own bf16 -> fp32 cast mangles subnormals.
    """
    if BF16_BITS:
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        return (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_param(ptr, offs, v, mask, PARAM_KIND: tl.constexpr):
    """Store float32 ``v`` (already rounded by :func:`_round_param`) in the storage dtype.

    bfloat16 (PARAM_KIND 2) goes through an int16 view as the top half of the float32 bits, which
    is exact; the interpreter's fp32 -> bf16 cast would flush subnormals.
    """
    if PARAM_KIND == 2:
        top = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        tl.store(ptr + offs, top.to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _params_kernel(
    x_ptr,
    scale_ptr,
    zero_ptr,
    n_rows,
    n_groups,
    group_len,
    stride_row,
    stride_group,
    stride_elem,
    LEVELS: tl.constexpr,
    SPECACHE: tl.constexpr,
    X_BF16: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Scale/zero of every group of ``x`` seen as ``[n_rows, n_groups, group_len]`` (strided).

    Token axis: row = token, group = channel group (stride G), elem = channel (stride 1).
    Channel axis: row = token group (stride G * D), group = channel (stride 1), elem = token (stride D).
    Writes scale/zero ``[n_rows, n_groups]`` contiguous, in the pointers' dtype.
    Program ``p`` handles rows ``[p * BLOCK_R, (p + 1) * BLOCK_R)`` and loops over the group in
    slices of BLOCK_B elements, so whole-axis groups (group_size=None) fit too.
    """
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    groups = tl.arange(0, BLOCK_A)
    row_mask = rows < n_rows
    group_mask = groups < n_groups
    base = rows[:, None, None] * stride_row + groups[None, :, None] * stride_group
    lo = tl.full([BLOCK_R, BLOCK_A], float("inf"), tl.float32)
    hi = tl.full([BLOCK_R, BLOCK_A], float("-inf"), tl.float32)
    for start in range(0, group_len, BLOCK_B):
        elems = start + tl.arange(0, BLOCK_B)
        mask = row_mask[:, None, None] & group_mask[None, :, None] & (elems < group_len)[None, None, :]
        v = _load_f32(x_ptr, base + elems[None, None, :] * stride_elem, mask, X_BF16)
        # min/max are exact, so the reduction order cannot change them (signed zeros aside: a
        # group whose extreme is 0 may give -0.0 where torch gives +0.0; they compare equal).
        lo = tl.minimum(lo, tl.min(tl.where(mask, v, float("inf")), axis=2))
        hi = tl.maximum(hi, tl.max(tl.where(mask, v, float("-inf")), axis=2))
    # Rows/groups past the end hold +-inf; zero them so no inf - inf is formed (results unstored).
    valid = row_mask[:, None] & group_mask[None, :]
    lo = tl.where(valid, lo, 0.0)
    hi = tl.where(valid, hi, 0.0)
    if SPECACHE:
        scale = tl.math.div_rn(hi - lo, 2.0)
        zero = tl.math.div_rn(3.0 * lo + hi, 4.0)
    else:
        scale = tl.math.div_rn(hi - lo, LEVELS - 1.0)
        zero = lo
    scale = _round_param(scale, PARAM_KIND)
    zero = _round_param(zero, PARAM_KIND)
    offs = rows[:, None] * n_groups + groups[None, :]
    _store_param(scale_ptr, offs, scale, valid, PARAM_KIND)
    _store_param(zero_ptr, offs, zero, valid, PARAM_KIND)


@triton.jit
def _digit_weights(LEVELS: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    """``L**i`` for digit ``i < C`` as ``[BLOCK_C]`` (int64 when WIDE, else int32); lanes >= C unused."""
    i = tl.arange(0, BLOCK_C)
    if WIDE:
        w = tl.full([BLOCK_C], 1, tl.int64)
    else:
        w = tl.full([BLOCK_C], 1, tl.int32)
    for k in tl.static_range(1, C):
        w = tl.where(i >= k, w * LEVELS, w)
    return w


@triton.jit
def _param_offsets(rows, chan, group_size, n_params, TOKEN_AXIS: tl.constexpr):
    """Offsets into scale/zero of each (token row, channel): ``[BLOCK_T, BLOCK_CH, BLOCK_C]``.

    ``rows`` is ``[BLOCK_T]`` (flat token index over leading dims), ``chan`` ``[BLOCK_CH, BLOCK_C]``.
    Token axis: params ``[rows, D // G]``; channel axis: ``[rows // G, D]`` (T is a multiple of G,
    so flat token groups never straddle two leading slices).
    """
    if TOKEN_AXIS:
        return rows[:, None, None] * n_params + (chan // group_size)[None, :, :]
    return (rows // group_size)[:, None, None] * n_params + chan[None, :, :]


@triton.jit
def _pack_kernel(
    x_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    n_rows,
    group_size,
    n_params,
    D: tl.constexpr,
    TOKEN_AXIS: tl.constexpr,
    X_BF16: tl.constexpr,
    P_BF16: tl.constexpr,
    LEVELS: tl.constexpr,
    C: tl.constexpr,
    M: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Codes of ``x [n_rows, D]`` against the stored scale/zero, packed to ``[n_rows, N_CHUNKS * M]``.

    The tile is ``[BLOCK_T tokens, BLOCK_CH chunks, BLOCK_C digits]`` with channel ``chunk * C + digit``,
    so one sum over the digit axis gives every chunk's word; the word's M little-endian bytes are
    then stored from a ``[BLOCK_T, BLOCK_CH, BLOCK_M]`` tile. Padding codes (channel >= D) are 0.
    """
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CH)
    digits = tl.arange(0, BLOCK_C)
    chan = chunks[:, None] * C + digits[None, :]
    row_mask = rows < n_rows
    mask = row_mask[:, None, None] & ((digits[None, :] < C) & (chan < D))[None, :, :]

    x = _load_f32(x_ptr, rows[:, None, None] * D + chan[None, :, :], mask, X_BF16)
    poffs = _param_offsets(rows, chan, group_size, n_params, TOKEN_AXIS)
    s = _load_f32(scale_ptr, poffs, mask, P_BF16)
    z = _load_f32(zero_ptr, poffs, mask, P_BF16)

    # quantize(): q = clamp(floor((x - z) / s + 0.5), 0, L - 1), and 0 where s == 0 (divide by 1
    # there so no inf/NaN is formed).
    flat = s == 0.0
    y = tl.math.div_rn(x - z, tl.where(flat, 1.0, s))
    q = tl.minimum(tl.maximum(tl.floor(y + 0.5), 0.0), LEVELS - 1.0)
    q = tl.where(flat | ~mask, 0.0, q)

    weights = _digit_weights(LEVELS, C, BLOCK_C, WIDE)
    # Digits are disjoint, so the sum has no carries: word < 256**M (<= 2**56, int64 when WIDE).
    word = tl.sum(q.to(weights.dtype) * weights[None, None, :], axis=2)

    nbytes = tl.arange(0, BLOCK_M)
    byte = (word[:, :, None] >> (8 * nbytes)[None, None, :]) & 0xFF
    out_mask = row_mask[:, None, None] & (chunks < N_CHUNKS)[None, :, None] & (nbytes < M)[None, None, :]
    out_offs = rows[:, None, None] * (N_CHUNKS * M) + (chunks[:, None] * M + nbytes[None, :])[None, :, :]
    tl.store(out_ptr + out_offs, byte.to(tl.uint8), mask=out_mask)


@triton.jit
def _unpack_kernel(
    packed_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    n_rows,
    group_size,
    n_params,
    D: tl.constexpr,
    TOKEN_AXIS: tl.constexpr,
    P_BF16: tl.constexpr,
    LEVELS: tl.constexpr,
    BITS: tl.constexpr,
    C: tl.constexpr,
    M: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Float32 ``[n_rows, D]`` from packed ``[n_rows, N_CHUNKS * M]`` bytes and scale/zero.

    Same tiling as :func:`_pack_kernel`, in reverse: the M bytes of each chunk are assembled into
    the word, the digits split off (shift/mask when ``L = 2**BITS``, else divide/modulo), and
    ``code * s + z`` stored.
    """
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CH)
    row_mask = rows < n_rows

    nbytes = tl.arange(0, BLOCK_M)
    in_mask = row_mask[:, None, None] & (chunks < N_CHUNKS)[None, :, None] & (nbytes < M)[None, None, :]
    in_offs = rows[:, None, None] * (N_CHUNKS * M) + (chunks[:, None] * M + nbytes[None, :])[None, :, :]
    raw = tl.load(packed_ptr + in_offs, mask=in_mask, other=0)
    if WIDE:
        raw = raw.to(tl.int64)
    else:
        raw = raw.to(tl.int32)
    word = tl.sum(raw << (8 * nbytes)[None, None, :], axis=2)

    digits = tl.arange(0, BLOCK_C)
    if BITS > 0:
        code = (word[:, :, None] >> (BITS * digits)[None, None, :]) & (LEVELS - 1)
    else:
        weights = _digit_weights(LEVELS, C, BLOCK_C, WIDE)
        code = (word[:, :, None] // weights[None, None, :]) % LEVELS

    chan = chunks[:, None] * C + digits[None, :]
    mask = row_mask[:, None, None] & ((digits[None, :] < C) & (chan < D))[None, :, :]
    poffs = _param_offsets(rows, chan, group_size, n_params, TOKEN_AXIS)
    s = _load_f32(scale_ptr, poffs, mask, P_BF16)
    z = _load_f32(zero_ptr, poffs, mask, P_BF16)
    # dequantize(): product and sum rounded separately (no FMA: launched with fp fusion off).
    out = code.to(tl.float32) * s + z
    tl.store(out_ptr + rows[:, None, None] * D + chan[None, :, :], out, mask=mask)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _check_axis(axis: str) -> None:
    if axis not in ("token", "channel"):
        raise ConfigError("axis", axis, "one of token, channel")


def _resolve_group(axis: str, t: int, d: int, group_size: int | None) -> int:
    """Group length G (as :func:`kvbench.quant.affine.quantize_grouped` resolves it), checked."""
    n = d if axis == "token" else t
    if group_size is None:
        return max(n, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    if n % group_size:
        what = f"head dim D={d}" if axis == "token" else f"token count T={t}"
        raise ValueError(f"{what} is not a multiple of group_size={group_size} (axis={axis})")
    return group_size


def _param_shape(lead: list[int], axis: str, t: int, d: int, g: int) -> tuple[int, ...]:
    """Scale/zero shape: ``[..., T, D // G]`` (token axis) or ``[..., T // G, D]`` (channel axis)."""
    return (*lead, t, d // g) if axis == "token" else (*lead, t // g, d)


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if device.type != "cuda" and not interpreting() and not planning_cuda():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def _pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton tile dimensions must be powers of two."""
    return triton.next_power_of_2(max(int(n), 1))


def _floor_pow2(n: int) -> int:
    """Largest power of two <= n (1 for n < 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def _tile_budget() -> int:
    return _INTERPRETER_TILE if interpreting() else _GPU_TILE


def _rows_per_block(row_elems: int, n_rows: int) -> int:
    """Rows per program so that a tile holds about one budget of elements, at most all rows."""
    return min(_floor_pow2(_tile_budget() // max(row_elems, 1)), _pow2(n_rows))


def _bits_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(tensor for the kernel, is_bf16)``: bfloat16 travels as its int16 bits (see _load_f32)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def _chunk_meta(levels: int, d: int) -> dict[str, int | bool]:
    """Compile-time layout of one packed row of ``d`` codes, shared by the pack and unpack kernels."""
    c, m = chunk_layout(levels)
    n_chunks = -(-d // c)
    return {
        "LEVELS": levels,
        "C": c,
        "M": m,
        "N_CHUNKS": n_chunks,
        # Words of 4+ bytes exceed int32 (L = 32: 5 bytes, L = 128: 7 bytes).
        "WIDE": 8 * m > 31,
        "BLOCK_CH": _pow2(n_chunks),
        "BLOCK_C": _pow2(c),
        "BLOCK_M": _pow2(m),
    }


def _launch_params(x3, scale, zero, axis, g, levels, zero_point) -> None:
    """Run ``_params_kernel`` over ``x3 [N, T, D]`` (contiguous) into flat scale/zero."""
    n, t, d = x3.shape
    if axis == "token":
        rows, groups, glen, strides = n * t, d // g, g, (d, g, 1)
    else:
        rows, groups, glen, strides = n * t // g, d, g, (g * d, 1, d)
    block_a = _pow2(groups)
    # Long groups (group_size=None on the channel axis) are reduced in slices of block_b.
    block_b = min(_pow2(glen), _floor_pow2(_tile_budget() // block_a))
    block_r = _rows_per_block(block_a * block_b, rows)
    x_arg, x_bf16 = _bits_view(x3)
    _params_kernel[(triton.cdiv(rows, block_r),)](
        x_arg,
        _bits_view(scale)[0],
        _bits_view(zero)[0],
        rows,
        groups,
        glen,
        *strides,
        LEVELS=levels,
        SPECACHE=zero_point == "specache",
        X_BF16=x_bf16,
        PARAM_KIND=_PARAM_KINDS[scale.dtype],
        BLOCK_R=block_r,
        BLOCK_A=block_a,
        BLOCK_B=block_b,
        enable_fp_fusion=False,
    )


def quantize_pack(
    x: torch.Tensor,
    levels: int,
    axis: str,
    group_size: int | None,
    zero_point: str = "minmax",
    param_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x: [..., T, D]`` and pack the codes along D (two kernel launches, two reads of x).

    Bit-identical to ``quantize_grouped`` followed by ``pack`` (see the module docstring).

    Args:
        x: ``[..., T, D]`` float32/float16/bfloat16, any leading dims, any strides.
        levels: level count ``L`` in 2..256.
        axis: ``"token"`` (groups of G channels per token) or ``"channel"`` (groups of G tokens per
            channel; T must be a multiple of G).
        group_size: G, or None for the whole axis.
        zero_point: ``"minmax"`` or ``"specache"`` (L = 2 only).
        param_dtype: storage dtype of scale/zero (float16, bfloat16 or float32).

    Returns:
        ``(packed, scale, zero)``: packed uint8 ``[..., T, packed_length(D, L)]``; scale and zero in
        ``param_dtype``, ``[..., T, D // G]`` (token axis) or ``[..., T // G, D]`` (channel axis).
    """
    require_triton()
    check_levels(levels)
    _check_axis(axis)
    if zero_point not in ("minmax", "specache"):
        raise ConfigError("zero_point", zero_point, "one of minmax, specache")
    if zero_point == "specache" and levels != 2:
        raise ConfigError("zero_point", zero_point, f"specache needs levels=2 (1 bit), got levels={levels}")
    if param_dtype not in _PARAM_KINDS:
        raise ValueError(f"param_dtype must be one of {list(_PARAM_KINDS)}, got {param_dtype}")
    if x.dim() < 2 or x.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"expected a float32/16 or bfloat16 tensor [..., T, D], got {x.dtype} {tuple(x.shape)}"
        )
    _check_device(x)
    *lead, t, d = x.shape
    g = _resolve_group(axis, t, d, group_size)

    packed = torch.empty(*lead, t, packed_length(d, levels), dtype=torch.uint8, device=x.device)
    scale = torch.empty(_param_shape(lead, axis, t, d, g), dtype=param_dtype, device=x.device)
    zero = torch.empty_like(scale)
    if x.numel() == 0:
        return packed, scale, zero
    x3 = x.reshape(-1, t, d).contiguous()
    _launch_params(x3, scale, zero, axis, g, levels, zero_point)

    meta = _chunk_meta(levels, d)
    rows = x3.shape[0] * t
    block_t = _rows_per_block(meta["BLOCK_CH"] * max(meta["BLOCK_C"], meta["BLOCK_M"]), rows)
    x_arg, x_bf16 = _bits_view(x3)
    (scale_arg, p_bf16), zero_arg = _bits_view(scale), _bits_view(zero)[0]
    _pack_kernel[(triton.cdiv(rows, block_t),)](
        x_arg,
        scale_arg,
        zero_arg,
        packed,
        rows,
        g,
        scale.shape[-1],
        D=d,
        TOKEN_AXIS=axis == "token",
        X_BF16=x_bf16,
        P_BF16=p_bf16,
        BLOCK_T=block_t,
        enable_fp_fusion=False,
        **meta,
    )
    return packed, scale, zero


def unpack_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    levels: int,
    axis: str,
    group_size: int | None,
    head_dim: int,
) -> torch.Tensor:
    """Float32 ``[..., T, D]`` reconstruction ``code * s + z`` straight from the packed bytes.

    Bit-identical to ``dequantize_grouped(unpack(packed, L, D), scale, zero, axis, group_size)``.

    Args:
        packed: uint8 ``[..., T, packed_length(D, L)]``.
        scale, zero: ``[..., T, D // G]`` (token axis) or ``[..., T // G, D]`` (channel axis), both
            float16 (the default storage), bfloat16 or float32.
        levels, axis, group_size: as given to :func:`quantize_pack`.
        head_dim: D, the number of codes per token (the packed row may hold padding codes).
    """
    require_triton()
    check_levels(levels)
    _check_axis(axis)
    if packed.dim() < 2 or packed.dtype != torch.uint8:
        raise ValueError(
            f"expected uint8 packed codes [..., T, bytes], got {packed.dtype} {tuple(packed.shape)}"
        )
    *lead, t, nbytes = packed.shape
    if nbytes != packed_length(head_dim, levels):
        raise ValueError(
            f"packed last axis has {nbytes} bytes; {head_dim} codes with levels={levels} take "
            f"{packed_length(head_dim, levels)}"
        )
    g = _resolve_group(axis, t, head_dim, group_size)
    expected = _param_shape(lead, axis, t, head_dim, g)
    if tuple(scale.shape) != expected or tuple(zero.shape) != expected:
        raise ValueError(
            f"scale/zero shapes {tuple(scale.shape)}/{tuple(zero.shape)} do not match packed "
            f"{tuple(packed.shape)} with axis={axis}, group_size={group_size}: expected {expected}"
        )
    if scale.dtype != zero.dtype or scale.dtype not in _PARAM_KINDS:
        raise ValueError(f"scale/zero must share one of {list(_PARAM_KINDS)}, got {scale.dtype}/{zero.dtype}")
    _check_device(packed, scale, zero)

    out = torch.empty(*lead, t, head_dim, dtype=torch.float32, device=packed.device)
    if out.numel() == 0:
        return out
    p3 = packed.reshape(-1, t, nbytes).contiguous()
    (scale_arg, p_bf16), zero_arg = _bits_view(scale.contiguous()), _bits_view(zero.contiguous())[0]
    meta = _chunk_meta(levels, head_dim)
    rows = p3.shape[0] * t
    block_t = _rows_per_block(meta["BLOCK_CH"] * max(meta["BLOCK_C"], meta["BLOCK_M"]), rows)
    bits = levels.bit_length() - 1 if levels & (levels - 1) == 0 else 0
    _unpack_kernel[(triton.cdiv(rows, block_t),)](
        p3,
        scale_arg,
        zero_arg,
        out,
        rows,
        g,
        scale.shape[-1],
        D=head_dim,
        TOKEN_AXIS=axis == "token",
        P_BF16=p_bf16,
        BITS=bits,
        BLOCK_T=block_t,
        enable_fp_fusion=False,
        **meta,
    )
    return out
