"""Device probe: packed reads of 3-, 5- and 6-bit codes (the LSB-first bit stream, where a code may
straddle two bytes) by the Triton part reader and the fused decode kernel, against their torch
references, under three ways of reading the second byte (``VARIANT``):

- ``masked``: a load masked by "this code straddles" (kvbench up to df6066b);
- ``main``: the byte read from an address chosen per lane (``decode_attention._unpack_tile`` now);
- ``word``: 3- and 6-bit codes read through the base-L word path instead of the bit stream (parts).

Prints one line per case: relative error of scores and mix (parts) or of the output (fused), "BAD"
above 1e-4. Run on the lent GPU (``benchmarks/gpu_h200/probe_variants.log`` is its output there,
whose "orig" is ``masked`` and "b" is ``main``); under ``TRITON_INTERPRET=1`` every case is exact.
The tests keep the failing shapes (``-m cuda``); the GPU refuses the widths not yet shown exact
(:data:`kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS`), so run the probe with that set emptied:
``VARIANT=main python scripts/gpu_probe_bitstream.py``.
"""

import os
import sys

# run from the repository root: kvbench and the part tests' helpers import from this checkout
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests", "kernels")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_triton_parts import DEVICE, B, H, gen, keys_like, on_device  # noqa: E402

import kvbench.kernels.decode_attention as da  # noqa: E402
import kvbench.kernels.runtime as runtime  # noqa: E402
import kvbench.kernels.triton_parts as tp  # noqa: E402
from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource  # noqa: E402
from kvbench.kernels.decode_attention import PackedKV, fused_decode_attention  # noqa: E402
from kvbench.kernels.quant_pack import quantize_pack  # noqa: E402
from kvbench.quant.affine import quantize_grouped  # noqa: E402
from kvbench.quant.attention_ref import decode_attention_reference  # noqa: E402
from kvbench.quant.packing import pack  # noqa: E402

VARIANT = os.environ.get("VARIANT", "main")
runtime.GPU_UNCHECKED_LEVELS = frozenset()  # probe every width


_MAIN_UNPACK = da._unpack_tile  # main's reads: every case the masked load leaves as it is


@triton.jit
def _unpack_tile_masked(
    row_ptr, chan, mask, LEVELS: tl.constexpr, CHUNK: tl.constexpr, WORD: tl.constexpr, BITS: tl.constexpr
):
    """main's ``_unpack_tile``, but a code straddling two bytes reads the second through a load
    masked by "this code straddles" (kvbench up to df6066b)."""
    if BITS > 0:
        if 8 % BITS != 0:
            bit = chan * BITS
            byte = bit // 8
            shift = bit % 8
            word = tl.load(row_ptr + byte[None, :], mask=mask, other=0).to(tl.int32)
            spill = (shift + BITS) > 8
            hi = tl.load(row_ptr + byte[None, :] + 1, mask=mask & spill[None, :], other=0).to(tl.int32)
            return ((word | (hi << 8)) >> shift[None, :]) & (LEVELS - 1)
    return _MAIN_UNPACK(row_ptr, chan, mask, LEVELS, CHUNK, WORD, BITS)


if VARIANT == "masked":
    tp._unpack_tile = _unpack_tile_masked
    da._unpack_tile = _unpack_tile_masked
if VARIANT == "word":
    orig_codes = tp._codes_args

    def codes_args(*a, **k):
        args, consts = orig_codes(*a, **k)
        if consts["BITS"] in (3, 6):
            consts["BITS"] = 0
        return args, consts

    tp._codes_args = codes_args

orig = tp._Plan.__init__
FORCE = {}
PLAN = []


def patched(self, rows, tokens, heads, d, device):
    orig(self, rows, tokens, heads, d, device)
    if "block_n" in FORCE:
        self.block_n = FORCE["block_n"]
        blocks = -(-tokens // self.block_n)
        splits = max(1, min(3, blocks))
        self.split_len = -(-blocks // splits) * self.block_n
        self.splits = max(1, -(-tokens // self.split_len))
    PLAN.append((self.block_m, self.block_n, self.num_warps, self.splits))


tp._Plan.__init__ = patched
R = tp.TritonReader()


def err(part, d, rows):
    g = gen(0)
    t = part.num_tokens
    q = torch.randn(B, H, rows, d, generator=g)
    w = torch.rand(B, H, rows, t, generator=g)
    dev = on_device(part)
    out = []
    for got, want in [
        (R.scores(dev, q.to(DEVICE)).cpu(), part.scores(q, 0, t)),
        (R.mix(dev, w.to(DEVICE)).cpu(), part.mix(w, 0, t)),
    ]:
        out.append(((got - want).abs().max() / want.abs().max()).item())
    return out


print("variant", VARIANT, flush=True)
for axis, L, grp, d, rows, bn in [
    ("channel", 8, 32, 128, 1, 32),
    ("channel", 8, 32, 128, 1, 64),
    ("channel", 8, 32, 128, 4, 64),
    ("channel", 8, 64, 128, 1, 64),
    ("channel", 32, 32, 128, 1, 64),
    ("channel", 64, 32, 128, 1, 64),
    ("channel", 8, 32, 64, 1, 64),
    ("token", 8, 32, 128, 1, 64),
]:
    FORCE.clear()
    FORCE["block_n"] = bn
    PLAN.clear()
    if axis == "channel":
        x = keys_like(grp * (200 // grp), d, 10 + L)
        codes, s, z = quantize_grouped(x, L, "channel", grp)
        part = PerChannelAffineSource(pack(codes, L), s, z, L, grp, d)
    else:
        x = keys_like(197, d, L)
        codes, s, z = quantize_grouped(x, L, "token", grp)
        part = PerTokenAffineSource(pack(codes, L), s, z, L, grp, d)
    try:
        e = err(part, d, rows)
        print(
            f"[{VARIANT}] part {axis:7s} L={L:<3d} G={grp:<3d} D={d:<3d} rows={rows} plan={PLAN[0]} "
            f"scores={e[0]:.2e} mix={e[1]:.2e} {'BAD' if max(e) > 1e-4 else 'ok'}",
            flush=True,
        )
    except Exception as ex:
        print(f"[{VARIANT}] part {axis} L={L} D={d} ERROR {type(ex).__name__}: {str(ex)[:200]}", flush=True)

dev = DEVICE
g = torch.Generator(device=dev).manual_seed(0)
for d in (64, 128):
    for L in (8, 32, 64):
        try:
            t, G = 512, 32
            b, h_kv, gqa, n0 = 2, 2, 4, t + 40
            q = torch.randn(b, h_kv * gqa, 1, d, generator=g, device=dev)
            spread = 0.5 + torch.randn(d, generator=g, device=dev).abs()
            keys = torch.randn(b, h_kv, n0, d, generator=g, device=dev) * spread
            values = torch.randn(b, h_kv, n0, d, generator=g, device=dev) + 0.3
            kq = PackedKV(*quantize_pack(keys[:, :, :t], L, "channel", G), L, G, "channel")
            vq = PackedKV(*quantize_pack(values[:, :, :t], L, "token", G), L, G, "token")
            k_res, v_res = keys[:, :, t:].half(), values[:, :, t:].half()
            out = fused_decode_attention(q, kq, vq, d**-0.5, k_res, v_res)
            ref = decode_attention_reference(q, [kq, k_res], [vq, v_res], d**-0.5)
            e = ((out - ref).abs().max() / ref.abs().max()).item()
            print(f"[{VARIANT}] fused L={L} D={d} rel={e:.2e} {'BAD' if e > 1e-4 else 'ok'}", flush=True)
        except Exception as ex:
            print(f"[{VARIANT}] fused L={L} D={d} ERROR {type(ex).__name__}: {str(ex)[:200]}", flush=True)
