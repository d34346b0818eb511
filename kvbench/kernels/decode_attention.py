"""Fused decode attention over a KIVI-style cache: packed codes dequantized inside the kernel.

The cache is read as in :mod:`kvbench.quant.attention_ref` (whose ``decode_attention_reference`` this
kernel must equal): a main key sequence ``[Kq, Kres]`` and a main value sequence ``[Vq, Vres]`` of the
same length ``N0`` (the quantized key and value parts may hold different token counts), then optional
full-precision extra entries ``[B, H_kv, E, D]`` appended to both. Token position ``p`` in
``[0, N0 + E)`` is read from whichever part holds it, so no part is ever materialised in full
precision.

Work split (flash-decoding): program ``(bh, s)`` takes one kv head of one sequence and the ``s``-th
contiguous slice of the token axis, and computes for all ``group * nq`` query rows of that kv head an
online softmax over its slice, blocks of ``BLOCK_N`` tokens at a time, leaving an unnormalised partial
``(max, sum, acc)``; a second kernel rescales the partials of the slices to their common max and
divides. Scores are kept in log2 units (the query is pre-multiplied by ``scaling * log2(e)``) so the
exponentials are ``exp2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvbench.kernels.runtime import (
    interpreter_numpy_compat,
    plans_for_cuda,
    refuse_unchecked_levels,
    sm_count,
)
from kvbench.quant.attention_ref import PackedKV
from kvbench.quant.packing import chunk_layout

interpreter_numpy_compat()  # triton < 3.7's interpreter under numpy >= 2.4

__all__ = ["PackedKV", "fused_decode_attention"]

_LOG2E = 1.4426950408889634
# Query rows per program are padded to this: GPU tl.dot needs M >= 16.
_MIN_BLOCK_M = 16
# Most query rows (group * nq) one program takes; decode has a handful, prefill belongs elsewhere.
_MAX_ROWS = 128


def gpu_launch_config(d: int) -> tuple[int, int]:
    """``(block_n, num_warps)`` of the partial kernel on a GPU for head dim ``d``.

    Chosen from the compiled kernels' ptxas resource usage for sm_90 and sm_80 (python -m
    kvbench.kernels.compile_check; the committed tables are benchmarks/triton_compile.md, triton 3.9,
    and benchmarks/triton_compile_3.6.md, the lent H200's triton). At d = 64, 64 tokens a block with
    4 warps take 200-255 registers: no spill under 3.9, but 8-16 B of stack at 5 levels (4-byte
    base-5 words) under 3.6; with 8 warps the same tile takes 186-242 registers and spills nothing
    under either (the token block, hence the serial walk of a split, stays 64). At d = 128 the
    64-token tile spills under every Triton tried (triton 3.6: 32 registers and 3.2-3.5 KB of stack
    per thread; 3.9: 0.8-3.4 KB): 32 tokens a block with 8 warps take 198-248 registers and spill
    nothing (3.6 and 3.9, sm_90 and sm_80), at 26 KB of shared memory. The ``tl.dot`` stays ieee
    (exact to float32 rounding); tf32 would free registers (120-178) at ~1e-3 relative error.
    """
    return (64, 8) if d <= 64 else (32, 8)


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _unpack_tile(
    row_ptr, chan, mask, LEVELS: tl.constexpr, CHUNK: tl.constexpr, WORD: tl.constexpr, BITS: tl.constexpr
):
    """int32 codes ``[BLOCK_N, D]`` of the packed rows ``row_ptr [BLOCK_N, 1]`` (0 where ~mask).

    ``BITS > 0`` (L = 2**BITS): the chunk words of the packing concatenate into one LSB-first bit
    stream, so code ``d`` sits at stream bit ``d * BITS``; it spans at most two bytes, which avoids
    assembling the int64 multi-byte words (L = 8, 32, 64, 128). Otherwise every chunk is a
    little-endian word of WORD bytes (1..4) holding CHUNK base-L digits; the word is assembled per
    code from its chunk's bytes (int64 for 4-byte words, which may exceed 2**31) and the digit
    divided out.
    """
    if BITS > 0:
        bit = chan * BITS
        byte = bit // 8
        shift = bit % 8
        word = tl.load(row_ptr + byte[None, :], mask=mask, other=0).to(tl.int32)
        if 8 % BITS != 0:
            # Only 3, 5, 6 and 7-bit codes can cross into the next byte (always inside the chunk).
            # A lane whose code does not cross reads its own byte again and drops it: the same
            # bytes as a load masked by ``spill``, which on an H200 (triton 3.6) read wrong values
            # in some launch shapes (kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS).
            spill = (shift + BITS) > 8
            nxt = tl.load(row_ptr + (byte + spill.to(tl.int32))[None, :], mask=mask, other=0).to(tl.int32)
            word = word | tl.where(spill[None, :], nxt << 8, 0)
        return (word >> shift[None, :]) & (LEVELS - 1)
    digit = chan % CHUNK
    weight = tl.full(chan.shape, 1, tl.int32)
    for i in tl.static_range(1, CHUNK):
        weight = tl.where(digit >= i, weight * LEVELS, weight)
    if WORD == 1:
        byte = tl.load(row_ptr + (chan // CHUNK)[None, :], mask=mask, other=0).to(tl.int32)
        return (byte // weight[None, :]) % LEVELS
    first = (chan // CHUNK) * WORD
    word = tl.load(row_ptr + first[None, :], mask=mask, other=0).to(tl.int64)
    for k in tl.static_range(1, WORD):
        byte = tl.load(row_ptr + first[None, :] + k, mask=mask, other=0).to(tl.int64)
        word = word | (byte << (8 * k))
    return ((word // weight.to(tl.int64)[None, :]) % LEVELS).to(tl.int32)


@triton.jit
def _dequant_tile(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    stride_ct,
    stride_st,
    tok,
    chan,
    live,
    LEVELS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    AXIS_TOKEN: tl.constexpr,
):
    """float32 ``[BLOCK_N, D]`` reconstruction ``code * scale + zero`` of the part's tokens ``tok``.

    ``tok [BLOCK_N]`` indexes the part's own tokens; rows where ``live`` is False come out 0 (every
    load is masked to 0). The pointers are already offset to one (batch, kv head).
    """
    mask = live[:, None]
    codes = _unpack_tile(codes_ptr + tok[:, None] * stride_ct, chan, mask, LEVELS, CHUNK, WORD, BITS)
    if AXIS_TOKEN:
        param = tok[:, None] * stride_st + (chan // GROUP)[None, :]
    else:
        param = (tok // GROUP)[:, None] * stride_st + chan[None, :]
    scale = tl.load(scale_ptr + param, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + param, mask=mask, other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def _dense_tile(ptr, stride_t, tok, chan, live):
    """float32 ``[BLOCK_N, D]`` rows ``tok`` of a full-precision part (0 where ~live)."""
    x = tl.load(ptr + tok[:, None] * stride_t + chan[None, :], mask=live[:, None], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _gather_block(
    block_start,
    pos,
    live,
    chan,
    q_codes,
    q_scale,
    q_zero,
    q_stride_ct,
    q_stride_st,
    res_ptr,
    res_stride_t,
    ext_ptr,
    ext_stride_t,
    n_quant,
    n_main,
    HAS_QUANT: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    AXIS_TOKEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """float32 ``[BLOCK_N, D]``: the keys (or values) at main/extra positions ``pos``.

    Position ``p`` lives in the quantized part for ``p < n_quant``, in the residual for
    ``n_quant <= p < n_main`` and in the extras from ``n_main`` on. Each part contributes its rows and
    zeros elsewhere, so the sum is exact; a part is only visited when the block overlaps it, so a
    block wholly inside the quantized part does no residual or extra loads and vice versa.
    """
    out = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    block_end = block_start + BLOCK_N
    if HAS_QUANT:
        if block_start < n_quant:
            out += _dequant_tile(
                q_codes,
                q_scale,
                q_zero,
                q_stride_ct,
                q_stride_st,
                pos,
                chan,
                live & (pos < n_quant),
                LEVELS,
                CHUNK,
                WORD,
                BITS,
                GROUP,
                AXIS_TOKEN,
            )
    if HAS_RES:
        if (block_end > n_quant) & (block_start < n_main):
            in_res = live & (pos >= n_quant) & (pos < n_main)
            out += _dense_tile(res_ptr, res_stride_t, pos - n_quant, chan, in_res)
    if HAS_EXTRA:
        if block_end > n_main:
            out += _dense_tile(ext_ptr, ext_stride_t, pos - n_main, chan, live & (pos >= n_main))
    return out


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    q_stride_b,
    q_stride_h,
    # quantized keys: codes, scale, zero, then (b, h, t) strides of the codes and of the parameters
    kq_codes,
    kq_scale,
    kq_zero,
    kq_cb,
    kq_ch,
    kq_ct,
    kq_sb,
    kq_sh,
    kq_st,
    # quantized values, same order
    vq_codes,
    vq_scale,
    vq_zero,
    vq_cb,
    vq_ch,
    vq_ct,
    vq_sb,
    vq_sh,
    vq_st,
    # residual keys / values and extra keys / values, each a pointer and (b, h, t) strides
    kr_ptr,
    kr_b,
    kr_h,
    kr_t,
    vr_ptr,
    vr_b,
    vr_h,
    vr_t,
    ek_ptr,
    ek_b,
    ek_h,
    ek_t,
    ev_ptr,
    ev_b,
    ev_h,
    ev_t,
    # partials: m, l [BH, S, BLOCK_M], acc [BH, S, BLOCK_M, D], contiguous float32
    m_ptr,
    l_ptr,
    acc_ptr,
    n_kq,
    n_vq,
    n_main,
    n_total,
    split_len,
    qk_scale,
    H_KV: tl.constexpr,
    NQ: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    HAS_KQ: tl.constexpr,
    K_LEVELS: tl.constexpr,
    K_CHUNK: tl.constexpr,
    K_WORD: tl.constexpr,
    K_BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_AXIS_TOKEN: tl.constexpr,
    HAS_VQ: tl.constexpr,
    V_LEVELS: tl.constexpr,
    V_CHUNK: tl.constexpr,
    V_WORD: tl.constexpr,
    V_BITS: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_AXIS_TOKEN: tl.constexpr,
    HAS_KR: tl.constexpr,
    HAS_VR: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Unnormalised online-softmax partial of one (sequence, kv head, token slice)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    # int64 so that batch/head offsets of large caches cannot overflow.
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    chan = tl.arange(0, D)
    row_ok = rows < ROWS
    # Rows are (head in group, query) pairs, query fastest: [B, H, nq, D] viewed as [B, H_kv, ROWS, D].
    q = tl.load(
        q_ptr + b * q_stride_b + h * q_stride_h + rows[:, None] * D + chan[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q = q.to(tl.float32) * qk_scale
    # Query i is main position n_main - NQ + i and must not see the newer main positions after it.
    own = n_main - NQ + rows % NQ

    kq_codes += b * kq_cb + h * kq_ch
    kq_scale += b * kq_sb + h * kq_sh
    kq_zero += b * kq_sb + h * kq_sh
    vq_codes += b * vq_cb + h * vq_ch
    vq_scale += b * vq_sb + h * vq_sh
    vq_zero += b * vq_sb + h * vq_sh
    kr_ptr += b * kr_b + h * kr_h
    vr_ptr += b * vr_b + h * vr_h
    ek_ptr += b * ek_b + h * ek_h
    ev_ptr += b * ev_b + h * ev_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    start = split * split_len
    end = tl.minimum(start + split_len, n_total)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        live = pos < end
        k = _gather_block(
            block_start, pos, live, chan,
            kq_codes, kq_scale, kq_zero, kq_ct, kq_st, kr_ptr, kr_t, ek_ptr, ek_t,
            n_kq, n_main,
            HAS_KQ, HAS_KR, HAS_EXTRA, K_LEVELS, K_CHUNK, K_WORD, K_BITS, K_GROUP, K_AXIS_TOKEN, BLOCK_N, D,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = live[None, :] & ((pos[None, :] <= own[:, None]) | (pos[None, :] >= n_main))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)

        v = _gather_block(
            block_start, pos, live, chan,
            vq_codes, vq_scale, vq_zero, vq_ct, vq_st, vr_ptr, vr_t, ev_ptr, ev_t,
            n_vq, n_main,
            HAS_VQ, HAS_VR, HAS_EXTRA, V_LEVELS, V_CHUNK, V_WORD, V_BITS, V_GROUP, V_AXIS_TOKEN, BLOCK_N, D,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    part = pid_bh * num_splits + split
    tl.store(m_ptr + part * BLOCK_M + rows, m_i)
    tl.store(l_ptr + part * BLOCK_M + rows, l_i)
    tl.store(acc_ptr + (part * BLOCK_M + rows[:, None]) * D + chan[None, :], acc)


@triton.jit
def _decode_reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    num_splits,
    H_KV: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    D: tl.constexpr,
):
    """Combine the split partials of one (sequence, kv head) into normalised output rows."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    chan = tl.arange(0, D)
    splits = tl.arange(0, BLOCK_S)
    first = pid_bh * num_splits

    tile = (first + splits[:, None]) * BLOCK_M + rows[None, :]
    split_ok = (splits < num_splits)[:, None]
    m = tl.load(m_ptr + tile, mask=split_ok, other=float("-inf"))
    sums = tl.load(l_ptr + tile, mask=split_ok, other=0.0)
    # Every query sees at least one token (checked by the caller), so m_max is finite and the
    # weight of a slice that saw nothing (max -inf) is exp2(-inf) = 0.
    m_max = tl.max(m, axis=0)
    denom = tl.sum(tl.math.exp2(m - m_max[None, :]) * sums, axis=0)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(m_ptr + (first + s) * BLOCK_M + rows)
        part = tl.load(acc_ptr + ((first + s) * BLOCK_M + rows[:, None]) * D + chan[None, :])
        acc += tl.math.exp2(m_s - m_max)[:, None] * part
    out = acc / denom[:, None]
    dest = out_ptr + b * out_stride_b + h * out_stride_h + rows[:, None] * D + chan[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=(rows < ROWS)[:, None])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Launch geometry: ``num_splits`` slices of ``split_len`` tokens (a multiple of ``block_n``)."""

    block_n: int
    num_splits: int
    split_len: int
    num_warps: int = 4


def _plan(n_total: int, programs_per_split: int, device: torch.device, block_n, num_splits, d: int) -> _Plan:
    """Pick block size and split count: enough programs to fill the GPU, few on the interpreter."""
    on_gpu = plans_for_cuda(device)
    gpu_block_n, num_warps = gpu_launch_config(d)
    if block_n is None:
        # The interpreter pays per operation, not per element: big blocks mean few iterations.
        block_n = gpu_block_n if on_gpu else min(512, max(16, triton.next_power_of_2(n_total)))
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    n_blocks = -(-n_total // block_n)
    if num_splits is None:
        if on_gpu:
            num_splits = -(-2 * sm_count(device) // programs_per_split)
        else:
            num_splits = 1
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    blocks_per_split = -(-n_blocks // min(num_splits, n_blocks))
    split_len = blocks_per_split * block_n
    # Recount so that no slice is empty.
    return _Plan(block_n, -(-n_total // split_len), split_len, num_warps)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last axis (the kernel indexes channels/bytes directly)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")


def _check_dense(name: str, x: torch.Tensor | None, lead: tuple[int, int], q: torch.Tensor) -> int:
    """Token count of an optional full-precision part ``[B, H_kv, t, D]``; raises on a bad shape."""
    if x is None:
        return 0
    d = q.shape[-1]
    _check_device(name, x, q.device)
    if x.dim() != 4 or (x.shape[0], x.shape[1]) != lead or x.shape[-1] != d or not x.is_floating_point():
        raise ValueError(
            f"{name} must be a float [B, H_kv, t, D] = [{lead[0]}, {lead[1]}, t, {d}], got "
            f"{x.dtype} {tuple(x.shape)}"
        )
    return x.shape[-2]


def _check_packed(name: str, part: PackedKV | None, lead: tuple[int, int], q: torch.Tensor) -> int:
    """Token count of an optional quantized part; raises on inconsistent tensors."""
    if part is None:
        return 0
    part.check(q.shape[-1])
    for field in ("codes", "scale", "zero"):
        _check_device(f"{name}.{field}", getattr(part, field), q.device)
    if tuple(part.codes.shape[:2]) != lead:
        raise ValueError(f"{name} codes have [B, H_kv] = {tuple(part.codes.shape[:2])}, expected {lead}")
    return part.num_tokens


def _lead_shape(parts) -> tuple[int, int]:
    """``(B, H_kv)`` from the first present part."""
    for p in parts:
        if p is not None:
            x = p.codes if isinstance(p, PackedKV) else p
            return x.shape[0], x.shape[1]
    raise ValueError("the cache is empty: no key/value part given")


def _packed_args(part: PackedKV | None, dummy: torch.Tensor) -> tuple[list, dict]:
    """Kernel pointer/stride arguments and constexprs of an optional quantized part."""
    if part is None or part.num_tokens == 0:
        # Never dereferenced: the HAS_* flag compiles the part out.
        return [dummy, dummy, dummy, 0, 0, 0, 0, 0, 0], dict(
            HAS=False, LEVELS=2, CHUNK=1, WORD=1, BITS=1, GROUP=1, AXIS_TOKEN=True
        )
    codes, scale, zero = _rows(part.codes), _rows(part.scale), _rows(part.zero)
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    levels = part.levels
    chunk, word = chunk_layout(levels)
    bits = levels.bit_length() - 1 if levels & (levels - 1) == 0 else 0
    args = [codes, scale, zero, *codes.stride()[:3], *scale.stride()[:3]]
    consts = dict(HAS=True, LEVELS=levels, CHUNK=chunk, WORD=word, BITS=bits, GROUP=part.group_size,
                  AXIS_TOKEN=part.axis == "token")  # fmt: skip
    return args, consts


def _dense_args(x: torch.Tensor | None, dummy: torch.Tensor) -> tuple[list, bool]:
    """Kernel pointer and (b, h, t) strides of an optional full-precision part, and whether it is there."""
    if x is None or x.shape[-2] == 0:
        return [dummy, 0, 0, 0], False
    x = _rows(x)
    return [x, *x.stride()[:3]], True


def fused_decode_attention(
    q: torch.Tensor,
    key_store: PackedKV | None,
    value_store: PackedKV | None,
    scaling: float,
    key_residual: torch.Tensor | None = None,
    value_residual: torch.Tensor | None = None,
    extra_keys: torch.Tensor | None = None,
    extra_values: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
    input_precision: str = "ieee",
) -> torch.Tensor:
    """Attention of ``nq`` new queries over a quantized + full-precision cache, in one fused pass.

    Args:
        q: ``[B, H, nq, D]`` (any float dtype), post-RoPE; ``H = H_kv * group``, query head ``h``
            reads kv head ``h // group``. D a power of two (64, 128).
        key_store: quantized keys ``Kq`` (``Tk`` tokens), or None. Any axis and level count 2..256;
            KIVI's are ``axis="channel"``.
        value_store: quantized values ``Vq`` (``Tv`` tokens), or None; KIVI's are ``axis="token"``.
        scaling: logit scale (``D ** -0.5`` for most models).
        key_residual, value_residual: full-precision ``[B, H_kv, Rk, D]`` / ``[B, H_kv, Rv, D]`` or None,
            the newest tokens; ``Tk + Rk == Tv + Rv == N0``. The queries' own entries are the last
            ``nq`` of these ``N0`` tokens: query ``i`` does not see the newest ``nq - 1 - i``.
        extra_keys, extra_values: full-precision ``[B, H_kv, E, D]`` or None (both or neither), seen
            by every query.
        block_n: tokens per inner iteration (power of two >= 16); default on GPU 64 for D <= 64 and
            32 above, with 8 warps, without register spills (:func:`gpu_launch_config`); large on
            the interpreter.
        num_splits: slices of the token axis (flash-decoding); default fills the GPU (1 on CPU).
        input_precision: of the two ``tl.dot`` products. ``"ieee"`` (default) is float32 exact to
            rounding; ``"tf32x3"`` is close to it and ``"tf32"`` (~1e-3 relative) is faster on GPUs.

    Returns:
        ``[B, H, nq, D]`` in ``q.dtype``.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H, nq, D], got {tuple(q.shape)}")
    batch, heads, nq, d = q.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim must be a power of two >= 16, got {d}")
    lead = _lead_shape((key_store, value_store, key_residual, value_residual, extra_keys, extra_values))
    if lead[0] != batch or heads % lead[1]:
        raise ValueError(f"q [B, H] = [{batch}, {heads}] does not fit a cache with [B, H_kv] = {list(lead)}")
    n_kq = _check_packed("key_store", key_store, lead, q)
    n_vq = _check_packed("value_store", value_store, lead, q)
    n_main = n_kq + _check_dense("key_residual", key_residual, lead, q)
    if n_vq + _check_dense("value_residual", value_residual, lead, q) != n_main:
        raise ValueError(f"keys hold {n_main} tokens but values {n_vq} + residual; they must be equal")
    n_extra = _check_dense("extra_keys", extra_keys, lead, q)
    if _check_dense("extra_values", extra_values, lead, q) != n_extra:
        raise ValueError("extra_keys and extra_values must hold the same number of tokens")
    if n_main < nq - 1 or n_main - (nq - 1) + n_extra < 1:
        raise ValueError(f"{nq} queries over {n_main} main + {n_extra} extra tokens: the first sees nothing")
    for name, store in (("key_store", key_store), ("value_store", value_store)):
        if store is not None:
            refuse_unchecked_levels(store.levels, q.device, f"fused_decode_attention's {name}")
    rows = heads // lead[1] * nq
    if rows > _MAX_ROWS:
        raise ValueError(f"group * nq = {rows} query rows per kv head exceeds {_MAX_ROWS} (a prefill shape)")

    n_total = n_main + n_extra
    bh = batch * lead[1]
    plan = _plan(n_total, bh, q.device, block_n, num_splits, d)
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(rows))

    q_rows = q.contiguous()
    out = torch.empty_like(q_rows)
    m_part = torch.empty(bh, plan.num_splits, block_m, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(bh, plan.num_splits, block_m, d, dtype=torch.float32, device=q.device)

    kq_args, kc = _packed_args(key_store, q_rows)
    vq_args, vc = _packed_args(value_store, q_rows)
    kr_args, has_kr = _dense_args(key_residual, q_rows)
    vr_args, has_vr = _dense_args(value_residual, q_rows)
    ek_args, has_extra = _dense_args(extra_keys, q_rows)
    ev_args, _ = _dense_args(extra_values, q_rows)
    # [B, H, nq, D] contiguous is [B, H_kv, group * nq, D]: batch stride H*nq*D, kv-head stride rows*D.
    q_strides = (heads * nq * d, rows * d)

    _decode_partial_kernel[(bh, plan.num_splits)](
        q_rows, *q_strides,
        *kq_args, *vq_args, *kr_args, *vr_args, *ek_args, *ev_args,
        m_part, l_part, acc_part,
        n_kq, n_vq, n_main, n_total, plan.split_len, scaling * _LOG2E,
        H_KV=lead[1], NQ=nq, ROWS=rows, BLOCK_M=block_m, BLOCK_N=plan.block_n, D=d,
        HAS_KQ=kc["HAS"], K_LEVELS=kc["LEVELS"], K_CHUNK=kc["CHUNK"], K_WORD=kc["WORD"], K_BITS=kc["BITS"],
        K_GROUP=kc["GROUP"], K_AXIS_TOKEN=kc["AXIS_TOKEN"],
        HAS_VQ=vc["HAS"], V_LEVELS=vc["LEVELS"], V_CHUNK=vc["CHUNK"], V_WORD=vc["WORD"], V_BITS=vc["BITS"],
        V_GROUP=vc["GROUP"], V_AXIS_TOKEN=vc["AXIS_TOKEN"],
        HAS_KR=has_kr, HAS_VR=has_vr, HAS_EXTRA=has_extra, DOT_PRECISION=input_precision,
        num_warps=plan.num_warps,
    )  # fmt: skip
    _decode_reduce_kernel[(bh,)](
        m_part, l_part, acc_part, out, *q_strides, plan.num_splits,
        H_KV=lead[1], ROWS=rows, BLOCK_M=block_m, D=d,
        BLOCK_S=max(2, triton.next_power_of_2(plan.num_splits)),
    )  # fmt: skip
    return out
