"""Whole-part ``scores`` and ``mix`` in Triton: the reader of ``backend=triton``.

:class:`TritonReader` is the :class:`~kvbench.cache.blockwise.PartReader` of the Triton backend, the
counterpart of the compiled CPU reader (:class:`~kvbench.kernels.cpu.parts.CompiledReader`). Each
``scores(part, q)`` / ``mix(part, p)`` is one kernel launch over every token of the part (plus a
few torch ops around it: a rotation matmul, a split reduction, the sparse outlier corrections), so
a decode step is a fixed number of launches per layer and nothing is read back to the host.

What a part is read with is declared by the part, in its own file, in the registry of
:mod:`kvbench.kernels.part_reads` (backend ``triton``); the reader offers these reads on plain
tensors:

- full-precision rows (:meth:`~TritonReader.rows_scores`): fp16, bf16 or fp32, read in place (bf16
  moves as int16 bits and is widened by hand: exact everywhere, the interpreter's bf16 casts are
  not);
- affine codes (:meth:`~TritonReader.token_affine_scores`, :meth:`~TritonReader.channel_affine_scores`
  and their mixes): packed codes at any level count (power-of-two bit streams and base-L words,
  decoded by :func:`~kvbench.kernels.decode_attention._unpack_tile`) with any group size;
- codebook codes (:meth:`~TritonReader.codebook_scores`): codes looked up in the codebook;
  scale/zero absent, one per token, one fixed row, or per channel group (any broadcastable shape:
  the kernel indexes parameters through ``(token // TG, channel // CG)`` with zero strides on
  broadcast axes); a per-head rotation as two torch matmuls (the query before the scores, the mixed
  value after); dense-and-sparse outliers corrected after the kernel by the torch expressions of the
  compiled reader (one scatter-add);
- pre-RoPE codebook keys without rotation (KVQuant's; a
  :class:`~kvbench.kernels.part_reads.RopeTable` given): every decoded row is rotated to its
  position inside the kernel from the layer's cos/sin table (the partner channel of the "rotate
  half" layout is decoded a second time rather than shuffled);
- a part built of others (TurboQuant's outlier channels, a channel split) reads its inner parts
  through :meth:`~kvbench.kernels.part_reads.KernelReader.part_scores` around the gather and scatter
  of :mod:`kvbench.kernels.channels`, so the split costs two launches, whatever the context.

Anything else (a part with no ``triton`` reads: bit planes; a rotation together with sparse
outliers, RoPE over another inner source) raises :class:`NotImplementedError` on ``backend=triton``
instead of falling back to torch:
a method whose parts the reader does not cover is refused on that backend when its config is built
(DESIGN.md: never run on part of its cache), so reaching one there is a bug, not a choice. Under
``backend=auto`` on a CUDA device the reader is not strict: such a part runs its torch reference
and the run records both backends (:func:`~kvbench.kernels.cpu.backend_in_use`).

Work split: program ``(b * H_kv + h, split, row tile)`` takes one kv head, a contiguous slice of
the tokens (walked in blocks of ``BLOCK_N``) and up to ``BLOCK_M`` query rows. Decode has few query
rows (GQA group x new tokens: 1 to 16): the products are broadcast multiplies summed with
``tl.sum`` over a ``[BLOCK_M, BLOCK_N, BLOCK_D]`` tile with ``BLOCK_M`` the rows rounded up to a
power of two (4 stays 4), and ``tl.dot`` is used only from 16 rows on, where its tiles fit.
``scores`` writes each slice's logits straight into ``[B, H_kv, M, T]``; ``mix`` writes one partial
``[M, D]`` per slice and one torch ``sum`` reduces the slices (split-K without atomics, so the
result does not depend on scheduling). On a GPU the slices fill the device; under the interpreter
there is one slice per head and large blocks, since it pays per operation, not per element.

Outputs are float32 ``[B, H_kv, M, T]`` / ``[B, H_kv, M, D]`` as the references' (the sources' own
``scores(q, 0, T)``/``mix(p, 0, T)``), equal to them up to float reassociation.

Triton is imported at module level: import this module only when
:func:`~kvbench.kernels.runtime.triton_available` holds (and, for the interpreter, after
``TRITON_INTERPRET=1`` is set).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.kernels.cpu import note_backend
from kvbench.kernels.decode_attention import _unpack_tile
from kvbench.kernels.outliers import _correct_mix, _correct_scores
from kvbench.kernels.part_reads import KernelReader, PackedCodes, RopeTable
from kvbench.kernels.quant_pack import _load_f32
from kvbench.kernels.runtime import (
    interpreter_numpy_compat,
    plans_for_cuda,
    refuse_unchecked_levels,
    sm_count,
)
from kvbench.quant.packing import chunk_layout

interpreter_numpy_compat()  # triton < 3.7's interpreter under numpy >= 2.4

# Query rows from which tl.dot is used (its GPU tiles need M >= 16); fewer rows take tl.sum.
DOT_ROWS = 16
# Most query rows one program takes (a prefill chunk's rows are tiled over programs).
MAX_BLOCK_M = 64
# Elements of the [BLOCK_M, BLOCK_N, BLOCK_D] product tile of the tl.sum path on a GPU.
GPU_SUM_TILE = 8192
# Tokens per block and token slices per head under the interpreter: few, large program instances
# (tests lower the block and raise the slices to walk the GPU's multi-block, split-K paths).
INTERPRETER_BLOCK_N = 512
INTERPRETER_SPLITS = 1


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_rows(
    data_ptr,
    s_dt,
    table_ptr,
    scale_ptr,
    s_st,
    s_sd,
    zero_ptr,
    s_zt,
    s_zd,
    tok,
    chan,
    live,
    D: tl.constexpr,
    KIND: tl.constexpr,
    X_BF16: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD: tl.constexpr,
    BITS: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    S_BF16: tl.constexpr,
    Z_BF16: tl.constexpr,
    TG_S: tl.constexpr,
    CG_S: tl.constexpr,
    TG_Z: tl.constexpr,
    CG_Z: tl.constexpr,
):
    """float32 ``[BLOCK_N, BLOCK_D]`` rows ``tok`` at channels ``chan`` of one (batch, kv head),
    0 where a row is not ``live`` or a channel is past ``D``. Pointers are already offset to the
    head. KIND 0: float rows (token stride ``s_dt``); KIND 1: packed codes (row stride ``s_dt``)
    mapped through the codebook (HAS_TABLE) or taken as numbers, then ``* scale + zero`` with each
    parameter at ``(tok // TG) * s_t + (chan // CG) * s_d`` (its own TG/CG; stride 0 on a broadcast
    axis)."""
    mask = live[:, None] & (chan < D)[None, :]
    if KIND == 0:
        return _load_f32(data_ptr, tok[:, None] * s_dt + chan[None, :], mask, X_BF16)
    codes = _unpack_tile(data_ptr + tok[:, None] * s_dt, chan, mask, LEVELS, CHUNK, WORD, BITS)
    if HAS_TABLE:
        x = tl.load(table_ptr + codes, mask=mask, other=0.0).to(tl.float32)
    else:
        x = codes.to(tl.float32)
    if HAS_SCALE:
        offs = (tok // TG_S)[:, None] * s_st + (chan // CG_S)[None, :] * s_sd
        x = x * _load_f32(scale_ptr, offs, mask, S_BF16)
    if HAS_ZERO:
        offs = (tok // TG_Z)[:, None] * s_zt + (chan // CG_Z)[None, :] * s_zd
        x = x + _load_f32(zero_ptr, offs, mask, Z_BF16)
    return x


@triton.jit
def _part_rows(
    data_ptr,
    s_dt,
    table_ptr,
    scale_ptr,
    s_st,
    s_sd,
    zero_ptr,
    s_zt,
    s_zd,
    cos_ptr,
    sin_ptr,
    s_cos,
    first_position,
    tok,
    chan,
    live,
    D: tl.constexpr,
    KIND: tl.constexpr,
    X_BF16: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD: tl.constexpr,
    BITS: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    S_BF16: tl.constexpr,
    Z_BF16: tl.constexpr,
    TG_S: tl.constexpr,
    CG_S: tl.constexpr,
    TG_Z: tl.constexpr,
    CG_Z: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    """:func:`_decode_rows`, rotated to positions ``first_position + tok`` when HAS_ROPE:
    ``x cos + rotate_half(x) sin`` with ``rotate_half([a, b]) = [-b, a]``
    (:func:`kvbench.quant.rope.rotate`); the partner channels are decoded a second time."""
    x = _decode_rows(
        data_ptr, s_dt, table_ptr, scale_ptr, s_st, s_sd, zero_ptr, s_zt, s_zd, tok, chan, live,
        D, KIND, X_BF16, LEVELS, CHUNK, WORD, BITS, HAS_TABLE, HAS_SCALE, HAS_ZERO, S_BF16, Z_BF16,
        TG_S, CG_S, TG_Z, CG_Z,
    )  # fmt: skip
    if HAS_ROPE:
        half = D // 2
        partner = tl.where(chan < half, chan + half, chan - half)
        y = _decode_rows(
            data_ptr, s_dt, table_ptr, scale_ptr, s_st, s_sd, zero_ptr, s_zt, s_zd, tok, partner, live,
            D, KIND, X_BF16, LEVELS, CHUNK, WORD, BITS, HAS_TABLE, HAS_SCALE, HAS_ZERO, S_BF16, Z_BF16, TG_S,
            CG_S, TG_Z, CG_Z,
        )  # fmt: skip
        mask = live[:, None] & (chan < D)[None, :]
        at = (first_position + tok)[:, None] * s_cos + chan[None, :]
        cos = tl.load(cos_ptr + at, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=mask, other=0.0).to(tl.float32)
        sign = tl.where(chan < half, -1.0, 1.0)
        x = x * cos + (y * sign[None, :]) * sin
    return x


@triton.jit
def _part_kernel(
    in_ptr,
    s_ib,
    s_ih,
    s_im,
    out_ptr,
    data_ptr,
    s_db,
    s_dh,
    s_dt,
    table_ptr,
    scale_ptr,
    s_sb,
    s_sh,
    s_st,
    s_sd,
    zero_ptr,
    s_zb,
    s_zh,
    s_zt,
    s_zd,
    cos_ptr,
    sin_ptr,
    s_cos,
    first_position,
    T,
    M,
    split_len,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    MIX: tl.constexpr,
    KIND: tl.constexpr,
    X_BF16: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD: tl.constexpr,
    BITS: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    S_BF16: tl.constexpr,
    Z_BF16: tl.constexpr,
    TG_S: tl.constexpr,
    CG_S: tl.constexpr,
    TG_Z: tl.constexpr,
    CG_Z: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (kv head, token slice, row tile) of ``scores`` (MIX False) or ``mix`` (MIX True).

    scores: ``in`` is the query ``[B, H_kv, M, D]`` (strides ``s_ib, s_ih, s_im``, unit channel
    stride), ``out`` the logits ``[B, H_kv, M, T]`` contiguous. mix: ``in`` is the weights
    ``[B, H_kv, M, T]`` (unit token stride), ``out`` the partials ``[B * H_kv, S, M, D]``."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    chan = tl.arange(0, BLOCK_D)
    chan_ok = chan < D
    data_ptr += b * s_db + h * s_dh
    scale_ptr += b * s_sb + h * s_sh
    zero_ptr += b * s_zb + h * s_zh
    in_ptr += b * s_ib + h * s_ih

    start = split * split_len
    end = tl.minimum(start + split_len, T)
    if MIX:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    else:
        # masked lanes must read 0, not whatever is there: 0 * garbage may be NaN on a GPU
        q_mask = row_ok[:, None] & chan_ok[None, :]
        q = tl.load(in_ptr + rows[:, None] * s_im + chan[None, :], mask=q_mask, other=0.0).to(tl.float32)
        out_ptr += pid_bh.to(tl.int64) * M * T
    for block in range(start, end, BLOCK_N):
        tok = block + tl.arange(0, BLOCK_N)
        live = tok < end
        x = _part_rows(
            data_ptr, s_dt, table_ptr, scale_ptr, s_st, s_sd, zero_ptr, s_zt, s_zd, cos_ptr, sin_ptr, s_cos,
            first_position, tok, chan, live,
            D, KIND, X_BF16, LEVELS, CHUNK, WORD, BITS, HAS_TABLE, HAS_SCALE, HAS_ZERO, S_BF16, Z_BF16, TG_S,
            CG_S, TG_Z, CG_Z, HAS_ROPE,
        )  # fmt: skip
        tile = row_ok[:, None] & live[None, :]
        if MIX:
            p = tl.load(in_ptr + rows[:, None] * s_im + tok[None, :], mask=tile, other=0.0).to(tl.float32)
            if USE_DOT:
                acc += tl.dot(p, x, input_precision="ieee")
            else:
                acc += tl.sum(p[:, :, None] * x[None, :, :], axis=1)
        else:
            if USE_DOT:
                s = tl.dot(q, tl.trans(x), input_precision="ieee")
            else:
                s = tl.sum(q[:, None, :] * x[None, :, :], axis=2)
            tl.store(out_ptr + rows[:, None] * T + tok[None, :], s, mask=tile)
    if MIX:
        part = pid_bh.to(tl.int64) * tl.num_programs(1) + split
        dest = out_ptr + (part * M + rows[:, None]) * D + chan[None, :]
        tl.store(dest, acc, mask=row_ok[:, None] & chan_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _bcast_strides(x: torch.Tensor, sizes: tuple[int, ...]) -> list[int]:
    """Strides of ``x`` over the leading axes ``sizes`` with 0 where ``x`` has size 1 (broadcast)."""
    return [x.stride(i) if x.shape[i] != 1 or n == 1 else 0 for i, n in enumerate(sizes)]


def _bits_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """bf16 travels as its int16 bits (widened by hand in :func:`_load_f32`)."""
    return (x.view(torch.int16), True) if x.dtype == torch.bfloat16 else (x, False)


def _param_args(p: torch.Tensor | None, b: int, h: int, t: int, d: int, dummy) -> tuple[list, dict]:
    """Pointer, ``(b, h, t, d)`` strides, tokens per row and channels per column of a scale or zero
    broadcastable to ``[B, H_kv, T, D]`` along its leading axes and groups along the last two: a
    token axis of T (one row per token), T // G (per-channel affine groups) or 1 (one fixed row),
    and a channel axis of D, D // G or 1."""
    if p is None:
        return [dummy, 0, 0, 0, 0], {"rows": 1, "cols": 1, "has": False, "bf16": False}
    if p.dim() != 4 or d % p.shape[-1] or (p.shape[-2] != 1 and t % p.shape[-2]):
        raise NotImplementedError(f"no Triton layout for parameters of shape {tuple(p.shape)}")
    p, bf16 = _bits_view(p)
    sb, sh = _bcast_strides(p, (b, h))
    rows = 1 if p.shape[-2] == 1 else t // p.shape[-2]
    st = 0 if p.shape[-2] == 1 and t != 1 else p.stride(-2)
    cols = d // p.shape[-1]
    sd = 0 if p.shape[-1] == 1 else p.stride(-1)
    return [p, sb, sh, st, sd], {"rows": rows, "cols": cols, "has": True, "bf16": bf16}


def _codes_args(part: PackedCodes, dummy) -> tuple[list, dict]:
    """Kernel arguments of packed codes ``[B, H_kv, T, bytes]`` with their table and parameters."""
    codes = part.codes if part.codes.stride(-1) == 1 else part.codes.contiguous()
    b, h, t, _ = codes.shape
    d = part.head_dim
    s_args, s = _param_args(part.scale, b, h, t, d, dummy)
    z_args, z = _param_args(part.zero, b, h, t, d, dummy)
    chunk, word = chunk_layout(part.levels)
    levels = part.levels
    table = part.table
    args = [codes, *_bcast_strides(codes, (b, h)), codes.stride(2), table if table is not None else dummy]
    args += [*s_args, *z_args]
    consts = dict(
        KIND=1, X_BF16=False, LEVELS=levels, CHUNK=chunk, WORD=word,
        BITS=levels.bit_length() - 1 if levels & (levels - 1) == 0 else 0,
        HAS_TABLE=table is not None, HAS_SCALE=s["has"], HAS_ZERO=z["has"], S_BF16=s["bf16"],
        Z_BF16=z["bf16"], TG_S=s["rows"], CG_S=s["cols"], TG_Z=z["rows"], CG_Z=z["cols"],
    )  # fmt: skip
    return args, consts


def _fp_args(data: torch.Tensor, dummy) -> tuple[list, dict]:
    data = data if data.stride(-1) == 1 else data.contiguous()
    x, bf16 = _bits_view(data)
    b, h = data.shape[:2]
    args = [x, *_bcast_strides(x, (b, h)), x.stride(2), dummy, dummy, 0, 0, 0, 0, dummy, 0, 0, 0, 0]
    consts = dict(
        KIND=0, X_BF16=bf16, LEVELS=2, CHUNK=1, WORD=1, BITS=1, HAS_TABLE=False, HAS_SCALE=False,
        HAS_ZERO=False, S_BF16=False, Z_BF16=False, TG_S=1, CG_S=1, TG_Z=1, CG_Z=1,
    )  # fmt: skip
    return args, consts


class _Plan:
    """Launch geometry for ``rows`` query rows over ``tokens`` tokens of ``heads`` (batch x kv head)
    programs' worth of work, head dim ``d``."""

    def __init__(self, rows: int, tokens: int, heads: int, d: int, device: torch.device):
        self.block_d = _pow2(d)
        self.block_m = min(_pow2(rows), MAX_BLOCK_M)
        self.use_dot = self.block_m >= DOT_ROWS and self.block_d >= 16
        self.row_tiles = -(-rows // self.block_m)
        self.num_warps = 4
        on_gpu = plans_for_cuda(device)
        if not on_gpu:
            self.block_n = max(16, min(INTERPRETER_BLOCK_N, _pow2(tokens)))
            splits = max(1, min(INTERPRETER_SPLITS, -(-tokens // self.block_n)))
        else:
            if self.use_dot and self.block_d > 64:
                # 64-token blocks with 4 warps spill at head_dim 128 (3.6: up to 8.8 KB per thread, 64 KB
                # of shared memory); 32 tokens a block with 8 warps take 80-200 registers and spill
                # nothing (kvbench.kernels.compile_check, benchmarks/triton_compile.md)
                self.block_n = 32
                self.num_warps = 8
            elif self.use_dot:
                # head_dim <= 64: 64-token blocks spill (4 warps: 136-816 B, 3.9; 8 warps: 3.6 KB on
                # sm_80 in mix), 32 with 4 warps 104-128 B, 32 with 8 warps an 8-byte stack frame at 3
                # and 6 levels on sm_90 (3.9), 16 with 4 warps 8 B at 5 levels in mix on sm_80 (3.6);
                # 16 tokens with 8 warps: 40-96 registers, no stack, 16-20 KB of shared memory, at
                # every level count, sm_90 and sm_80, triton 3.6 and 3.9
                self.block_n = 16
                self.num_warps = 8
            else:
                fit = GPU_SUM_TILE // (self.block_m * self.block_d)
                self.block_n = max(8, min(64, 1 << max(fit, 1).bit_length() - 1))
            wanted = -(-2 * sm_count(device) // (heads * self.row_tiles))
            splits = max(1, min(wanted, -(-tokens // self.block_n)))
        blocks = -(-tokens // self.block_n)
        self.split_len = -(-blocks // splits) * self.block_n
        self.splits = max(1, -(-tokens // self.split_len))


def _launch(
    layout: torch.Tensor | PackedCodes, x: torch.Tensor, mix: bool, rope: RopeTable | None, where: str
) -> torch.Tensor:
    """One launch of :func:`_part_kernel` over the whole part: ``layout`` is full-precision rows
    ``[B, H_kv, T, D]`` or :class:`PackedCodes`. ``x``: float32 query ``[B, H_kv, M, D]`` (scores)
    or weights ``[B, H_kv, M, T]`` (mix). ``where`` names the part in a refusal."""
    rows = isinstance(layout, torch.Tensor)
    b, h, m, _ = x.shape
    t = layout.shape[-2] if rows else layout.num_tokens
    d = layout.shape[-1] if rows else layout.head_dim
    if t == 0:  # nothing stored in this part (the layouts below divide by the token count)
        return x.new_zeros(b, h, m, d) if mix else x.new_zeros(b, h, m, 0)
    args, consts = _fp_args(layout, x) if rows else _codes_args(layout, x)
    if consts["KIND"] == 1:
        refuse_unchecked_levels(consts["LEVELS"], x.device, f"TritonReader ({where})")
    if rope is not None:
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        rope_args = [cos, sin, cos.stride(0), rope.first_position]
    else:
        rope_args = [x, x, 0, 0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    plan = _Plan(m, t, b * h, d, x.device)
    if mix:
        out = torch.empty(b * h, plan.splits, m, d, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(b, h, m, t, dtype=torch.float32, device=x.device)
    _part_kernel[(b * h, plan.splits, plan.row_tiles)](
        x, x.stride(0), x.stride(1), x.stride(2), out, *args, *rope_args, t, m, plan.split_len,
        H_KV=h, D=d, MIX=mix, HAS_ROPE=rope is not None, USE_DOT=plan.use_dot,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, **consts,
        num_warps=plan.num_warps,
    )  # fmt: skip
    if mix:
        return out.sum(dim=1).view(b, h, m, d)
    return out


_ROPE_ROTATION = "the Triton reader rotates pre-RoPE codebook keys without a rotation only"


class TritonReader(KernelReader):
    """Whole-part scores and mixes through :func:`_part_kernel` (module docstring: what it reads).

    ``strict`` (``backend=triton``): a part the reader does not cover raises, since the method was
    admitted on the promise that every part is read by Triton. Not strict (``backend=auto`` on a
    CUDA device, where methods without Triton coverage also run): such a part returns None and its
    torch reference runs, as the compiled CPU reader does, and the run records both backends."""

    backend = "triton"

    def __init__(self, strict: bool = True):
        self.strict = strict
        self._where = ""  # the part being read, for a refusal's message

    def decline(self, why: str) -> None:
        raise NotImplementedError(why)

    def _binding(self, part, which, rope):
        self._where = type(part).__name__
        return super()._binding(part, which, rope)

    def _declined(self, part) -> bool:
        if self.covers(part):
            return False
        if self.strict:
            raise NotImplementedError(
                f"backend=triton reads no {type(part).__name__} part of this layout; the method "
                "should have been refused on triton"
            )
        note_backend("torch")
        return True

    def _read(self, how, part, x: torch.Tensor) -> torch.Tensor | None:
        if self._declined(part):
            return None
        try:
            out = how(part, x.float())
        except NotImplementedError:  # a covered type in a layout the kernel does not take
            if self.strict:
                raise
            note_backend("torch")
            return None
        note_backend("triton")
        return out

    def scores(self, part, query: torch.Tensor) -> torch.Tensor | None:
        """``query [B, H_kv, M, D]`` float32 -> logits ``[B, H_kv, M, T]`` float32."""
        return self._read(self.part_scores, part, query)

    def mix(self, part, weights: torch.Tensor) -> torch.Tensor | None:
        """``weights [B, H_kv, M, T]`` float32 -> ``[B, H_kv, M, D]`` float32."""
        return self._read(self.part_mix, part, weights)

    # -- the reads parts register (plain tensors) ------------------------------------------------
    def rows_scores(self, query, data: torch.Tensor):
        """Full-precision rows ``data [B, H_kv, T, D]`` (fp16, bf16 or fp32)."""
        return _launch(data, query, False, None, self._where)

    def rows_mix(self, weights, data: torch.Tensor):
        return _launch(data, weights, True, None, self._where)

    def token_affine_scores(self, query, part: PackedCodes):
        """Affine codes (no table) with per-token parameters: the group is in their shape."""
        return _launch(part, query, False, None, self._where)

    def token_affine_mix(self, weights, part: PackedCodes, group_size: int):
        return _launch(part, weights, True, None, self._where)

    def channel_affine_scores(self, query, part: PackedCodes, group_size: int):
        """Affine codes with per-channel parameters over groups of tokens (``T // G`` rows)."""
        return _launch(part, query, False, None, self._where)

    def channel_affine_mix(self, weights, part: PackedCodes, group_size: int):
        return _launch(part, weights, True, None, self._where)

    def codebook_scores(self, query, part: PackedCodes, rotation=None, rope: RopeTable | None = None):
        """Codebook codes, rotated by ``rotation [H_kv, D, D]`` (stored ``Pi x``) or, as pre-RoPE
        keys, to their positions by ``rope``; outliers corrected after the kernel."""
        if rope is not None:
            if rotation is not None:
                raise NotImplementedError(_ROPE_ROTATION)
            out = _launch(part, query, False, rope, self._where)
            return out if part.outliers is None else _correct_scores(out, part, query, rope)
        if part.outliers is not None and rotation is not None:
            raise NotImplementedError("sparse outliers over rotated codes have no Triton reader")
        q = query if rotation is None else torch.matmul(query, rotation.transpose(-1, -2))
        out = _launch(part, q, False, None, self._where)
        return out if part.outliers is None else _correct_scores(out, part, query, None)

    def codebook_mix(self, weights, part: PackedCodes, rotation=None, rope: RopeTable | None = None):
        """The mix of codebook codes, rotated back by ``rotation``; pre-RoPE values are rotated in
        the kernel (no store holds them, but nothing forbids them) when they have no outliers."""
        if rope is not None:
            if part.outliers is not None:
                raise NotImplementedError("pre-RoPE values with sparse outliers have no Triton reader")
            if rotation is not None:
                raise NotImplementedError(_ROPE_ROTATION)
            return _launch(part, weights, True, rope, self._where)
        if part.outliers is not None and rotation is not None:
            raise NotImplementedError("sparse outliers over rotated codes have no Triton reader")
        out = _launch(part, weights, True, None, self._where)
        if rotation is not None:
            out = torch.matmul(out, rotation)
        if part.outliers is not None:
            out = _correct_mix(out, part, weights)
        return out

    @staticmethod
    def codebook_covers(part: PackedCodes, rotation=None, rope: RopeTable | None = None) -> bool:
        """Whether :meth:`codebook_scores` and :meth:`codebook_mix` read this layout."""
        if rope is not None:
            return rotation is None
        return part.outliers is None or rotation is None


def covers(part) -> bool:
    """Whether :class:`TritonReader` reads ``part``: what the strict reader checks before a launch."""
    return TritonReader().covers(part)
