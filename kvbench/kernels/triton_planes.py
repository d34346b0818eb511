"""ReadKV's decode reads in Triton: prefix reads of bit-plane codes and the budgeted allocation
(ReadKV, Amazon / UC Berkeley: query-adaptive reads of a progressive KV cache; the method is
:mod:`kvbench.methods.readkv`). ``backend=triton`` needs these so that the whole read stays on the
GPU, one launch per call over the whole store, with no host sync.

The same four calls as the compiled CPU module (``kvbench/kernels/cpu/planes.cpp``), with the same
arguments and results, so :func:`kvbench.methods.readkv.compiled_query_adaptive_attention` runs on
either: :class:`TritonPlanes` stands in for the module. The plain-torch references are
:func:`kvbench.methods.readkv.blockwise_query_adaptive_attention` (prefix reads of
:meth:`~kvbench.methods.readkv.PlaneStore.read_codes` reconstructed by
:func:`~kvbench.quant.progressive.prefix_reconstruct`) and
:func:`kvbench.quant.progressive.allocate_prefix_bits`.

A B-bit code q read at prefix p reconstructs at the centre of its bin (ReadKV's progressive code,
:mod:`kvbench.quant.progressive`):

    x_p = z + s ((q & ~(2^(B-p) - 1)) + 2^(B-p) / 2 - 1/2),

and the cleared code is the OR of bit B-1-j of q over the planes j < p. A program therefore loads
plane j of an entry only where some query row sharing the kv head reads more than j bits (a masked
load, so the other planes' bytes are never fetched), as the compiled kernels do.

- :meth:`TritonPlanes.plane_key_scores`: ``out[m, t] = scaling * sum_c q[m, c] x_p(t, c)``, key
  planes packed along tokens (one byte holds one channel's bit of 8 tokens), per-channel scale/zero
  over groups of G tokens. Grid ``(B * H_kv, token blocks)``; a block is whole octets.
- :meth:`TritonPlanes.plane_value_mix`: ``out[m, d] = sum_t a[m, t] x_p(t, d)``, value planes packed
  along channels, per-token scale/zero over groups of G channels. Grid ``(B * H_kv, token blocks)``;
  each program writes its block's partial sum and one torch sum over blocks follows (no atomics, so
  the result does not depend on the order in which programs finish).
- :meth:`TritonPlanes.allocate_prefix`: per row, the k = min(budget, N * B) largest refinement gains
  ``w_i 2^-j`` counted per item. One program per row finds the k-th largest gain exactly by a
  radix search over its float32 bits (gains are non-negative, so their bit patterns order as the
  values do: 31 counting passes, no sort, no top-k of N * B gains), then takes every gain above it
  and the ties at it from the lowest item up. An item's B gains are its weight's pattern minus
  j << 23 unless they leave the normal floats, so a pass counts them with one subtraction per item,
  gain by gain only in a block that holds a weight below 2^(B-126) (gains that may round). The
  gains are the reference's float32 products ``w * 2^-j``, so without ties at the threshold this is
  the reference's allocation bit for bit (the reference leaves ties to ``topk``; the compiled
  kernel breaks them the same way as here).
- :meth:`TritonPlanes.plane_rms`: the reference's own torch expression (``sqrt(mean(s^2))`` over the
  groups), so the allocation weights equal the reference's bit for bit; a kernel would only
  reorder the sum.

Nothing here waits on the device: shapes, budgets and bit widths are host integers, and no result
is read back. Under ``TRITON_INTERPRET=1`` (CPU tests) the programs run as numpy, so tiles are made
larger there (fewer program instances).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvbench.kernels.runtime import interpreter_numpy_compat, interpreting, planning_cuda, require_triton

interpreter_numpy_compat()  # triton < 3.7's interpreter under numpy >= 2.4

__all__ = ["TritonPlanes", "triton_planes"]

# Elements of one [tokens, channels] tile: a few thousand keep a GPU program's tile in registers;
# the interpreter runs a program as whole-array numpy ops, so there bigger tiles are faster.
_GPU_TILE = 4096
_INTERPRETER_TILE = 1 << 15
# (item, bit) gains per block of the allocation's counting passes (one row per program on a GPU,
# as many rows as fit under the interpreter).
_GPU_ITEMS = 4096
_INTERPRETER_ITEMS = 1 << 16


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_param(ptr, offs, mask, BF16: tl.constexpr):
    """float32 scale/zero at ``ptr + offs``; bfloat16 arrives as its int16 bits and is widened on
    them (the interpreter's own bf16 cast is unreliable)."""
    if BF16:
        raw = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        return (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _prefix_terms(p, BITS: tl.constexpr):
    """For prefix lengths ``p`` (int32, 0..BITS): the mask that keeps a code's top p bits, and the
    bin-centre offset 2^(BITS-p) / 2 - 1/2 (exact in float32)."""
    width = tl.full(p.shape, 1, tl.int32) << (BITS - p)
    keep = (tl.full(p.shape, (1 << BITS) - 1, tl.int32) // width) * width
    return keep, width.to(tl.float32) * 0.5 - 0.5


@triton.jit
def _key_scores_kernel(
    q_ptr, planes_ptr, scale_ptr, zero_ptr, prefix_ptr, out_ptr,
    H, M, T, D,
    sq_b, sq_h, sq_m, sq_d,
    sp_b, sp_h, sp_o, sp_c,
    ss_b, ss_h, ss_g, ss_d,
    sz_b, sz_h, sz_g, sz_d,
    sf_b, sf_h, sf_m, sf_d,
    so_b, so_h, so_m, so_t,
    scaling,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Program (b * H + h, i): the logits ``out[b, h, :, t]`` of tokens ``t`` in octets
    ``[i * BLOCK_O, (i + 1) * BLOCK_O)``. Planes ``[B, H, T / 8, BITS * D]`` (byte ``j * D + c`` of
    octet o: bit BITS-1-j of channel c for tokens 8o..8o+7), scale/zero ``[B, H, T / GROUP, D]``,
    query and prefix ``[B, H, M, D]``. The codes are assembled once for all M rows (from the planes
    the longest row prefix needs) and each row masks its own prefix out of them."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    octet = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    lane = tl.arange(0, 8)
    chan = tl.arange(0, BLOCK_D)
    live_o = octet < T // 8
    live_d = chan < D
    pre = prefix_ptr + b * sf_b + h * sf_h
    # the planes some row sharing this kv head reads, per channel
    need = tl.zeros([BLOCK_D], tl.int32)
    for m in range(M):
        need = tl.maximum(need, tl.load(pre + m * sf_m + chan * sf_d, mask=live_d, other=0).to(tl.int32))
    # the codes of the block's tokens as far as `need` asks: [BLOCK_O, 8, BLOCK_D], token 8 o + lane
    rows = planes_ptr + b * sp_b + h * sp_h + octet[:, None] * sp_o
    code = tl.zeros([BLOCK_O, 8, BLOCK_D], tl.int32)
    for j in tl.static_range(BITS):
        read = live_o[:, None] & (live_d & (need > j))[None, :]
        byte = tl.load(rows + (j * D + chan)[None, :] * sp_c, mask=read, other=0).to(tl.int32)
        code = code | (((byte[:, None, :] >> lane[None, :, None]) & 1) << (BITS - 1 - j))
    code = tl.reshape(code, [BLOCK_O * 8, BLOCK_D])
    tok = tl.program_id(1) * (BLOCK_O * 8) + tl.arange(0, BLOCK_O * 8)
    live = (tok < T)[:, None] & live_d[None, :]
    group = (tok // GROUP)[:, None]
    s = _load_param(scale_ptr + b * ss_b + h * ss_h, group * ss_g + chan[None, :] * ss_d, live, BF16)
    z = _load_param(zero_ptr + b * sz_b + h * sz_h, group * sz_g + chan[None, :] * sz_d, live, BF16)
    qb = q_ptr + b * sq_b + h * sq_h
    ob = out_ptr + b * so_b + h * so_h
    for m in range(M):
        q = tl.load(qb + m * sq_m + chan * sq_d, mask=live_d, other=0.0)
        p = tl.load(pre + m * sf_m + chan * sf_d, mask=live_d, other=0).to(tl.int32)
        keep, centre = _prefix_terms(p, BITS)
        x = ((code & keep[None, :]).to(tl.float32) + centre[None, :]) * s + z
        tl.store(ob + m * so_m + tok * so_t, tl.sum(x * q[None, :], axis=1) * scaling, mask=tok < T)


@triton.jit
def _value_mix_kernel(
    w_ptr, planes_ptr, scale_ptr, zero_ptr, prefix_ptr, part_ptr,
    H, M, T, D, D8,
    sw_b, sw_h, sw_m, sw_t,
    sp_b, sp_h, sp_t, sp_c,
    ss_b, ss_h, ss_t, ss_g,
    sz_b, sz_h, sz_t, sz_g,
    sf_b, sf_h, sf_m, sf_t,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D8: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    """Program (b * H + h, i): ``part[b * H + h, i, m, :] = sum_t w[m, t] x_p(t, :)`` over tokens
    ``[i * BLOCK_T, (i + 1) * BLOCK_T)``. Planes ``[B, H, T, BITS * D8]`` (byte ``j * D8 + k``: bit
    BITS-1-j of channels 8k..8k+7), scale/zero ``[B, H, T, D / GROUP]``, weights and prefix
    ``[B, H, M, T]``, partials ``[B * H, blocks, M, D]`` contiguous."""
    bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    tok = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    octet = tl.arange(0, BLOCK_D8)
    lane = tl.arange(0, 8)
    live_t = tok < T
    pre = prefix_ptr + b * sf_b + h * sf_h
    need = tl.zeros([BLOCK_T], tl.int32)
    for m in range(M):
        need = tl.maximum(need, tl.load(pre + m * sf_m + tok * sf_t, mask=live_t, other=0).to(tl.int32))
    # codes [BLOCK_T, BLOCK_D8, 8]: channel 8 k + lane, from the planes some row reads
    rows = planes_ptr + b * sp_b + h * sp_h + tok[:, None] * sp_t
    code = tl.zeros([BLOCK_T, BLOCK_D8, 8], tl.int32)
    for j in tl.static_range(BITS):
        read = (live_t & (need > j))[:, None] & (octet < D8)[None, :]
        byte = tl.load(rows + (j * D8 + octet)[None, :] * sp_c, mask=read, other=0).to(tl.int32)
        code = code | (((byte[:, :, None] >> lane[None, None, :]) & 1) << (BITS - 1 - j))
    code = tl.reshape(code, [BLOCK_T, BLOCK_D8 * 8])
    chan = tl.arange(0, BLOCK_D8 * 8)
    live = live_t[:, None] & (chan < D)[None, :]
    group = (chan // GROUP)[None, :]
    s = _load_param(scale_ptr + b * ss_b + h * ss_h, tok[:, None] * ss_t + group * ss_g, live, BF16)
    z = _load_param(zero_ptr + b * sz_b + h * sz_h, tok[:, None] * sz_t + group * sz_g, live, BF16)
    wb = w_ptr + b * sw_b + h * sw_h
    out = part_ptr + (bh.to(tl.int64) * tl.num_programs(1) + blk) * M * D
    for m in range(M):
        a = tl.load(wb + m * sw_m + tok * sw_t, mask=live_t, other=0.0).to(tl.float32)
        p = tl.load(pre + m * sf_m + tok * sf_t, mask=live_t, other=0).to(tl.int32)
        keep, centre = _prefix_terms(p, BITS)
        x = ((code & keep[:, None]).to(tl.float32) + centre[:, None]) * s + z
        tl.store(out + m * D + chan, tl.sum(a[:, None] * x, axis=0), mask=chan < D)


@triton.jit
def _gain_bits(w, BITS: tl.constexpr, BITS_P2: tl.constexpr):
    """int32 bit patterns ``[ROWS, BLOCK_N, BITS_P2]`` of the gains w_i 2^-j of ``w [ROWS, BLOCK_N]``
    (j < BITS; -1 elsewhere, below every gain). 2^-j is built on its exponent bits, so it is exact on
    every device."""
    j = tl.arange(0, BITS_P2)
    step = ((127 - j) << 23).to(tl.float32, bitcast=True)
    g = (w[:, :, None] * step[None, None, :]).to(tl.int32, bitcast=True) & 0x7FFFFFFF  # -0.0 is 0
    return tl.where((j < BITS)[None, None, :], g, -1)


@triton.jit
def _count_at_least(w, live, c, BITS: tl.constexpr, BITS_P2: tl.constexpr):
    """int32 ``[ROWS, BLOCK_N]``: how many of each item's gains have a bit pattern >= ``c [ROWS]``
    (0 where ~live). An item of weight 0 has BITS gains 0. Where every weight of the block is 0 or
    at least 2^(BITS-126), each gain w 2^-j is a normal float whose pattern is w's minus j << 23,
    so the count is one subtraction; a block holding a smaller weight (whose gains may be
    subnormal, and round) compares gain by gain."""
    wb = w.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tiny = live & (wb > 0) & (wb < (BITS << 23))
    if tl.sum(tl.sum(tiny.to(tl.int32), axis=1), axis=0) > 0:
        g = _gain_bits(w, BITS, BITS_P2)
        n = tl.sum((g >= c[:, None, None]).to(tl.int32), axis=2)
    else:
        n = tl.minimum(tl.maximum(((wb - c[:, None]) >> 23) + 1, 0), BITS)
        n = tl.where(wb == 0, tl.where(c[:, None] <= 0, BITS, 0), n)
    return tl.where(live, n, 0)


@triton.jit
def _allocate_kernel(
    w_ptr, out_ptr, R, N, k,
    BITS: tl.constexpr, BITS_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Rows ``[p * ROWS, (p + 1) * ROWS)`` of weights ``[R, N]`` (float32, contiguous) -> prefix
    lengths ``out [R, N]`` (int64), the k largest gains of each row (module docstring)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    items = tl.arange(0, BLOCK_N)
    live_r = row < R
    # 1. tau: the bit pattern of the k-th largest gain of each row, the largest pattern with at least
    # k gains at or above it, built bit by bit from the top (k = 0 sets every bit: none lies above)
    tau = tl.zeros([ROWS], tl.int32)
    for i in range(31):  # a loop, not unrolled: 31 copies of the passes would only grow the code
        cand = tau | (1 << (30 - i))
        count = tl.zeros([ROWS], tl.int32)
        for start in range(0, N, BLOCK_N):
            live = live_r[:, None] & (start + items < N)[None, :]
            w = tl.load(w_ptr + row[:, None] * N + (start + items)[None, :], mask=live, other=0.0)
            count += tl.sum(_count_at_least(w, live, cand, BITS, BITS_P2), axis=1)
        tau = tl.where(count >= k, cand, tau)
    # 2. every gain above tau: patterns >= tau + 1 (k = 0's all-ones tau is kept from wrapping)
    over = tl.minimum(tau, 0x7FFFFFFE) + 1
    taken = tl.zeros([ROWS], tl.int32)
    for start in range(0, N, BLOCK_N):
        live = live_r[:, None] & (start + items < N)[None, :]
        w = tl.load(w_ptr + row[:, None] * N + (start + items)[None, :], mask=live, other=0.0)
        taken += tl.sum(_count_at_least(w, live, over, BITS, BITS_P2), axis=1)
    # 3. the ties at tau, from the lowest item up, until k are taken
    ties = k - taken
    for start in range(0, N, BLOCK_N):
        live = live_r[:, None] & (start + items < N)[None, :]
        w = tl.load(w_ptr + row[:, None] * N + (start + items)[None, :], mask=live, other=0.0)
        above = _count_at_least(w, live, over, BITS, BITS_P2)
        equal = _count_at_least(w, live, tau, BITS, BITS_P2) - above
        before = tl.cumsum(equal, axis=1) - equal  # ties at lower items of this block
        extra = tl.minimum(tl.maximum(ties[:, None] - before, 0), equal)
        at = row[:, None] * N + (start + items)[None, :]
        tl.store(out_ptr + at, (above + extra).to(tl.int64), mask=live)
        ties -= tl.sum(equal, axis=1)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _param(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(tensor for a kernel, is_bf16)``: bfloat16 parameters travel as their int16 bits."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    if x.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scale/zero must be float16, bfloat16 or float32, got {x.dtype}")
    return x, False


def _check(where: str, *xs: torch.Tensor) -> None:
    device = xs[0].device
    if any(x.device != device for x in xs):
        raise ValueError(f"{where}: tensors on different devices: {[str(x.device) for x in xs]}")
    if device.type != "cuda" and not interpreting() and not planning_cuda():
        raise ValueError(f"{where}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def _tile() -> int:
    return _INTERPRETER_TILE if interpreting() else _GPU_TILE


class TritonPlanes:
    """ReadKV's plane kernels in Triton, with the compiled module's call signatures (``plane_rms``,
    ``allocate_prefix``, ``plane_key_scores``, ``plane_value_mix``), so
    :func:`~kvbench.methods.readkv.compiled_query_adaptive_attention` takes either.
    ``block_tokens`` (tokens per program of the scores and the mix) and ``block_items`` (items per
    block of the allocation's passes) override the defaults; tests use them to cut a store or a row
    into several blocks (powers of two, ``block_tokens >= 8``)."""

    def __init__(self, block_tokens: int | None = None, block_items: int | None = None):
        for name, value, least in (("block_tokens", block_tokens, 8), ("block_items", block_items, 1)):
            if value is not None and (value < least or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
        self.block_tokens, self.block_items = block_tokens, block_items

    def _block(self, head_dim: int) -> int:
        if self.block_tokens is not None:
            return self.block_tokens
        return max(8, _tile() // _pow2(head_dim))

    def plane_rms(self, scale: torch.Tensor, dim: int) -> torch.Tensor:
        """float32 root-mean-square of the fp16 ``scale`` over its groups: ``[B, H_kv, D]`` per key
        channel (``dim=-2``, scale ``[B, H_kv, T / G, D]``) or ``[B, H_kv, T]`` per value token
        (``dim=-1``, scale ``[B, H_kv, T, D / G]``). The reference's expression itself."""
        if dim not in (-1, -2):
            raise ValueError(f"dim must be -1 or -2, got {dim}")
        return scale.float().pow(2).mean(dim).sqrt()

    def allocate_prefix(self, weights: torch.Tensor, bits: int, budget: int) -> torch.Tensor:
        """int64 prefix lengths ``[..., N]`` (each 0..bits) for weights ``[..., N]`` (>= 0): the
        ``min(budget, N * bits)`` largest gains of each row, ties at the threshold to the lowest
        item (module docstring). Weights are not checked for sign: that would wait on the device."""
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        _check("allocate_prefix", weights)
        n = weights.shape[-1]
        out = torch.empty(weights.shape, dtype=torch.long, device=weights.device)
        rows = out.numel() // n if n else 0
        if rows == 0:
            return out
        w = weights.float().reshape(rows, n).contiguous()
        k = max(0, min(int(budget), n * bits))
        budget_items = (_INTERPRETER_ITEMS if interpreting() else _GPU_ITEMS) // _pow2(bits)
        block = min(_pow2(n), self.block_items or budget_items)
        per = min(_pow2(rows), max(1, budget_items // block)) if interpreting() else 1
        _allocate_kernel[(triton.cdiv(rows, per),)](
            w, out, rows, n, k, BITS=bits, BITS_P2=_pow2(bits), ROWS=per, BLOCK_N=block
        )
        return out

    def plane_key_scores(
        self,
        query: torch.Tensor,
        planes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        prefix: torch.Tensor,
        bits: int,
        group: int,
        scaling: float,
    ) -> torch.Tensor:
        """Scaled logits float32 ``[B, H_kv, M, T]`` of queries ``[B, H_kv, M, D]`` (float32)
        against keys read at per-channel prefixes ``prefix [B, H_kv, M, D]`` from token-packed
        planes ``uint8 [B, H_kv, T / 8, bits * D]`` with scale/zero ``[B, H_kv, T / G, D]``."""
        _check("plane_key_scores", query, planes, scale, zero, prefix)
        b, h, m, d = query.shape
        t = planes.shape[2] * 8
        if group % 8 or t % group or planes.shape[3] != bits * d or scale.shape[2] != t // group:
            raise ValueError(
                f"plane_key_scores: keys must be whole groups of G={group} tokens (a multiple of 8) "
                f"with planes [B, H, T / 8, bits * D]; got planes {tuple(planes.shape)}, "
                f"scale {tuple(scale.shape)}, D={d}, bits={bits}"
            )
        out = torch.empty(b, h, m, t, dtype=torch.float32, device=query.device)
        if t == 0 or m == 0:
            return out
        q = query.float()
        s, bf16 = _param(scale)
        z, _ = _param(zero)
        octets = self._block(d) // 8
        grid = (b * h, triton.cdiv(t // 8, octets))
        _key_scores_kernel[grid](
            q, planes, s, z, prefix, out, h, m, t, d,
            *q.stride(), *planes.stride(), *s.stride(), *z.stride(), *prefix.stride(), *out.stride(),
            float(scaling),
            BITS=bits, GROUP=group, BLOCK_O=octets, BLOCK_D=_pow2(d), BF16=bf16,
        )  # fmt: skip
        return out

    def plane_value_mix(
        self,
        weights: torch.Tensor,
        planes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        prefix: torch.Tensor,
        bits: int,
        group: int,
        head_dim: int,
    ) -> torch.Tensor:
        """float32 ``[B, H_kv, M, D]``: weights ``[B, H_kv, M, T]`` (any strides) times values read
        at per-token prefixes ``prefix [B, H_kv, M, T]`` from channel-packed planes
        ``uint8 [B, H_kv, T, bits * ceil(D / 8)]`` with scale/zero ``[B, H_kv, T, D / G]``."""
        _check("plane_value_mix", weights, planes, scale, zero, prefix)
        b, h, m, t = weights.shape
        d, d8 = head_dim, -(-head_dim // 8)
        if group % 8 or d % group or planes.shape[2] != t or planes.shape[3] != bits * d8:
            raise ValueError(
                f"plane_value_mix: values need groups of G={group} channels (a multiple of 8 dividing "
                f"D={d}) and planes [B, H, T, bits * ceil(D / 8)]; got planes {tuple(planes.shape)}"
            )
        if t == 0 or m == 0:
            return torch.zeros(b, h, m, d, dtype=torch.float32, device=weights.device)
        w = weights if weights.dtype == torch.float32 else weights.float()
        s, bf16 = _param(scale)
        z, _ = _param(zero)
        block = self._block(d)
        blocks = triton.cdiv(t, block)
        partial = torch.empty(b * h, blocks, m, d, dtype=torch.float32, device=weights.device)
        _value_mix_kernel[(b * h, blocks)](
            w, planes, s, z, prefix, partial, h, m, t, d, d8,
            *w.stride(), *planes.stride(), *s.stride(), *z.stride(), *prefix.stride(),
            BITS=bits, GROUP=group, BLOCK_T=block, BLOCK_D8=_pow2(d8), BF16=bf16,
        )  # fmt: skip
        return partial.sum(1).view(b, h, m, d)


@functools.cache
def _shared() -> TritonPlanes:
    return TritonPlanes()


def triton_planes(key: str = "method.backend") -> TritonPlanes:
    """The Triton plane kernels for ReadKV's ``backend=triton`` reads; a ConfigError naming ``key``
    where Triton cannot run (no CUDA device and no ``TRITON_INTERPRET=1``)."""
    require_triton(key)
    return _shared()
