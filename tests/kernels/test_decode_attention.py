"""Tests for the fused decode-attention kernel and its plain-torch reference.

Without CUDA the kernel runs under Triton's CPU interpreter (``conftest.py`` in this folder turns it
on before triton is imported); shapes here are small and blocks large so that few program instances
run. Inputs are fresh random draws each run; the seed is in every failure message for replaying.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvbench.kernels.decode_attention import PackedKV, fused_decode_attention
from kvbench.kernels.runtime import GPU_UNCHECKED_LEVELS, cuda_launch_plan, gpu_reads_levels
from kvbench.quant.affine import fake_quantize_grouped, quantize_grouped
from kvbench.quant.attention_ref import decode_attention_reference
from kvbench.quant.packing import pack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run; ``initial_seed()`` names it in failure messages."""
    return torch.Generator(device=DEVICE).manual_seed(int.from_bytes(os.urandom(4), "little"))


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=DEVICE) * scale


def packed(x: torch.Tensor, levels: int, axis: str, group: int) -> PackedKV:
    """Quantize ``x [B, H_kv, T, D]`` the way ``QuantizedTokens`` stores it."""
    codes, scale, zero = quantize_grouped(x, levels, axis, group)
    return PackedKV(pack(codes, levels), scale, zero, levels, group, axis)


@dataclass
class Case:
    """A KIVI-shaped cache: keys ``[Kq (tk), Kres]``, values ``[Vq (tv), Vres]``, both ``n0`` long."""

    tk: int
    tv: int
    n0: int
    extra: int = 0
    nq: int = 1
    k_levels: int = 4
    v_levels: int = 4
    d: int = 64
    group: int = 32
    block_n: int | None = None
    num_splits: int | None = None


def build(case: Case, g: torch.Generator, batch: int = 2, h_kv: int = 2, gqa: int = 3, logit_scale=1.0):
    """Random queries and cache parts for ``case``; returns (q, kernel kwargs, reference args)."""
    d = case.d
    q = randn(g, batch, h_kv * gqa, case.nq, d, scale=logit_scale)
    # Keys get per-channel offsets and spreads (the outlier channels KIVI quantizes per channel for).
    keys = randn(g, batch, h_kv, case.n0, d) * (0.5 + randn(g, d).abs()) + randn(g, d)
    keys = keys * logit_scale
    values = randn(g, batch, h_kv, case.n0, d) + 0.3
    kq = packed(keys[:, :, : case.tk], case.k_levels, "channel", case.group) if case.tk else None
    vq = packed(values[:, :, : case.tv], case.v_levels, "token", case.group) if case.tv else None
    # Residuals in fp16, as the caches keep them.
    k_res = keys[:, :, case.tk :].half()
    v_res = values[:, :, case.tv :].half()
    ek = ev = None
    if case.extra:
        ek = randn(g, batch, h_kv, case.extra, d, scale=logit_scale)
        ev = randn(g, batch, h_kv, case.extra, d)
    scaling = d**-0.5
    kwargs = dict(key_residual=k_res, value_residual=v_res, extra_keys=ek, extra_values=ev)
    ref = decode_attention_reference(q, [kq, k_res], [vq, v_res], scaling, ek, ev)
    out = fused_decode_attention(
        q, kq, vq, scaling, **kwargs, block_n=case.block_n, num_splits=case.num_splits
    )  # fmt: skip
    return q, out, ref


def assert_matches(out: torch.Tensor, ref: torch.Tensor, g: torch.Generator, rel: float = 1e-4) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    torch.testing.assert_close(
        out, ref, atol=rel * scale, rtol=0, msg=lambda m: f"{m}\n(seed {g.initial_seed()}, scale {scale:.3g})"
    )


# ---------------------------------------------------------------------------------------------
# The reference against hand computation
# ---------------------------------------------------------------------------------------------


def test_reference_tiny_case_by_hand():
    # scaling 1, q = e0: logits are k[:, 0]; k1 = ln 3 gives weights 1/4, 3/4.
    q = torch.tensor([1.0, 0.0]).expand(1, 1, 2, 2)
    k = torch.tensor([[0.0, 5.0], [math.log(3.0), -2.0]])[None, None]
    v = torch.tensor([[4.0, 0.0], [0.0, 8.0]])[None, None]
    out = decode_attention_reference(q, [k[:, :, :1], k[:, :, 1:]], [v], 1.0)
    # Query 0 is main position 0 and sees only it; query 1 sees both.
    torch.testing.assert_close(out[0, 0], torch.tensor([[4.0, 0.0], [1.0, 6.0]]))


@pytest.mark.parametrize("nq", [1, 2])
def test_reference_full_precision_equals_sdpa(gen, nq):
    b, h_kv, gqa, d, n0, e = 2, 2, 3, 16, 11, 4
    q = randn(gen, b, h_kv * gqa, nq, d)
    keys, values = randn(gen, b, h_kv, n0 + e, d), randn(gen, b, h_kv, n0 + e, d)
    # Keys split at 7, values at 3: the split points must not matter.
    k_parts = [keys[:, :, :7], keys[:, :, 7:n0]]
    v_parts = [values[:, :, :3], None, values[:, :, 3:n0]]
    out = decode_attention_reference(q, k_parts, v_parts, 0.3, keys[:, :, n0:], values[:, :, n0:])
    mask = torch.ones(nq, n0 + e, dtype=torch.bool, device=DEVICE)
    if nq == 2:
        mask[0, n0 - 1] = False  # the first query must not see the second's entry
    expected = F.scaled_dot_product_attention(
        q,
        keys.repeat_interleave(gqa, dim=1),
        values.repeat_interleave(gqa, dim=1),
        attn_mask=mask,
        scale=0.3,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_dequantizes_like_the_quantizer(gen):
    keys, values = randn(gen, 1, 2, 64, 64), randn(gen, 1, 2, 64, 64)
    q = randn(gen, 1, 4, 1, 64)
    kq, vq = packed(keys, 3, "channel", 32), packed(values, 8, "token", 32)
    out = decode_attention_reference(q, [kq], [vq], 0.125)
    k_fake = fake_quantize_grouped(keys, 3, "channel", 32)
    v_fake = fake_quantize_grouped(values, 8, "token", 32)
    torch.testing.assert_close(out, decode_attention_reference(q, [k_fake], [v_fake], 0.125))


# ---------------------------------------------------------------------------------------------
# The kernel against the reference
# ---------------------------------------------------------------------------------------------

CASES = {
    # tk a multiple of G (keys are quantized in whole token groups); everything else ragged.
    "kivi-2bit-nq1": Case(tk=96, tv=101, n0=133, block_n=32, num_splits=3),
    "mixed-3-8-extras-nq2": Case(
        tk=128,
        tv=70,
        n0=133,
        extra=9,
        nq=2,
        k_levels=3,
        v_levels=8,
        d=128,
        group=64,
        block_n=64,
        num_splits=2,
    ),
    "5-levels-no-key-residual": Case(tk=64, tv=40, n0=64, extra=13, nq=2, k_levels=5, v_levels=5, block_n=16),
    "binary-no-value-residual": Case(tk=32, tv=52, n0=52, nq=2, k_levels=2, v_levels=2, d=128, num_splits=2),
    "8-levels-default-plan": Case(tk=192, tv=150, n0=203, extra=4, k_levels=8, v_levels=8, group=64),
    "no-quantized-part": Case(tk=0, tv=0, n0=37, extra=5, nq=2, block_n=16, num_splits=2),
    "no-residual": Case(tk=64, tv=64, n0=64, extra=6, k_levels=5, v_levels=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(gen, name):
    _, out, ref = build(CASES[name], gen)
    assert_matches(out, ref, gen)


@pytest.mark.parametrize("levels", [*range(2, 17), 17, 24, 32, 40, 64, 84, 256])
def test_every_level_count(gen, levels):
    # Both axes on both sides, so each unpacking path meets each parameter layout.
    b, h_kv, d, t = 1, 2, 64, 64
    q = randn(gen, b, h_kv * 2, 1, d)
    keys, values = randn(gen, b, h_kv, t, d), randn(gen, b, h_kv, t, d)
    for k_axis, v_axis in (("channel", "token"), ("token", "channel")):
        kq, vq = packed(keys, levels, k_axis, 32), packed(values, levels, v_axis, 32)
        if not gpu_reads_levels(levels, q.device):
            with pytest.raises(NotImplementedError, match=f"levels={levels}"):
                fused_decode_attention(q, kq, vq, 0.125)
            continue
        ref = decode_attention_reference(q, [kq], [vq], 0.125)
        assert_matches(fused_decode_attention(q, kq, vq, 0.125), ref, gen)


@pytest.mark.parametrize("levels", sorted(GPU_UNCHECKED_LEVELS))
def test_cuda_plan_refuses_unchecked_bit_widths(gen, levels):
    # 5-7-bit streams read wrong on the H200 (triton 3.6); the CUDA plan refuses them by name
    # before any launch, and 3-bit codes (checked there) still plan.
    keys = randn(gen, 1, 1, 64, 64)
    q = randn(gen, 1, 2, 1, 64)
    with cuda_launch_plan():
        kq, vq = packed(keys, levels, "channel", 32), packed(keys, 4, "token", 32)
        with pytest.raises(
            NotImplementedError, match=f"key_store.*{levels.bit_length() - 1}-bit.*levels={levels}"
        ):
            fused_decode_attention(q, kq, vq, 0.125)
        assert gpu_reads_levels(8, q.device) and not gpu_reads_levels(levels, q.device)
    assert gpu_reads_levels(levels, torch.device("cpu"))


def test_large_logits_are_stable(gen):
    # Logits in the hundreds: exp overflows float32 beyond 88 without the running max.
    case = Case(tk=64, tv=50, n0=90, extra=3, nq=2, block_n=32, num_splits=2)
    _, out, ref = build(case, gen, logit_scale=6.0)
    assert_matches(out, ref, gen)


def test_first_query_does_not_see_second_entry(gen):
    case = Case(tk=32, tv=40, n0=45, nq=2, block_n=16, num_splits=2)
    q = randn(gen, 2, 6, 2, 64)
    keys, values = randn(gen, 2, 2, case.n0, 64), randn(gen, 2, 2, case.n0, 64)
    kq, vq = packed(keys[:, :, :32], 4, "channel", 32), packed(values[:, :, :40], 4, "token", 32)

    def attend(k_res, v_res):
        return fused_decode_attention(q, kq, vq, 0.125, k_res, v_res, block_n=16, num_splits=2)

    base = attend(keys[:, :, 32:], values[:, :, 40:])
    k2, v2 = keys[:, :, 32:].clone(), values[:, :, 40:].clone()
    k2[:, :, -1] += 3.0
    v2[:, :, -1] -= 5.0
    moved = attend(k2, v2)
    torch.testing.assert_close(moved[:, :, 0], base[:, :, 0], atol=1e-6, rtol=0)
    assert not torch.allclose(moved[:, :, 1], base[:, :, 1])


def test_rejects_mismatched_token_counts(gen):
    keys, values = randn(gen, 1, 1, 64, 64), randn(gen, 1, 1, 64, 64)
    kq, vq = packed(keys, 4, "channel", 32), packed(values, 4, "token", 32)
    with pytest.raises(ValueError, match="tokens"):
        fused_decode_attention(randn(gen, 1, 2, 1, 64), kq, vq, 0.125, value_residual=values[:, :, :3])


# ---------------------------------------------------------------------------------------------
# Full size, on a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [64, 128])
def test_three_bit_codes_on_cuda(gen, d):
    # The shape in which 3-bit codes read wrong on the H200 before the second byte's load took an
    # address per lane (relative error 0.73 at head_dim 64; kvbench.kernels.runtime).
    q = randn(gen, 2, 8, 1, d)
    keys = randn(gen, 2, 2, 552, d) * (0.5 + randn(gen, d).abs())
    values = randn(gen, 2, 2, 552, d) + 0.3
    kq, vq = packed(keys[:, :, :512], 8, "channel", 32), packed(values[:, :, :512], 8, "token", 32)
    k_res, v_res = keys[:, :, 512:].half(), values[:, :, 512:].half()
    out = fused_decode_attention(q, kq, vq, d**-0.5, k_res, v_res)
    ref = decode_attention_reference(q, [kq, k_res], [vq, v_res], d**-0.5)
    assert_matches(out, ref, gen)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nq", [1, 2])
def test_full_size_on_cuda(gen, nq):
    b, h, h_kv, t, d, g, r = 8, 32, 8, 32768, 128, 32, 128
    # float32 queries give a float32 output, so the comparison sees the kernel, not fp16 rounding.
    q = randn(gen, b, h, nq, d)
    kq = packed(randn(gen, b, h_kv, t, d).half(), 4, "channel", g)
    vq = packed(randn(gen, b, h_kv, t - 40, d).half(), 4, "token", g)
    k_res = randn(gen, b, h_kv, r - 40, d).half()
    v_res = randn(gen, b, h_kv, r, d).half()
    out = fused_decode_attention(q, kq, vq, d**-0.5, k_res, v_res)
    # One sequence at a time keeps the reference's float32 cache (repeated over heads) small.
    for i in range(b):
        one = [
            PackedKV(p.codes[i : i + 1], p.scale[i : i + 1], p.zero[i : i + 1], 4, g, p.axis)
            for p in (kq, vq)
        ]
        ref = decode_attention_reference(
            q[i : i + 1], [one[0], k_res[i : i + 1]], [one[1], v_res[i : i + 1]], d**-0.5
        )
        assert_matches(out[i : i + 1], ref, gen)
