"""Tests for the block sources (kvbench.cache.source, .fp, .affine_source, .codebook_source) and
kvbench.cache.blockwise: every source reads what its storage reconstructs, and blockwise
attention equals SDPA over the materialized cache (float32, relative tolerance 1e-5) for every source
kind, grouped-query attention, block sizes that do and do not divide the length, partly full
residuals, an empty quantized part, decode (q = 1) and chunked scoring (q > 1, causal tail)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.blockwise import block_ranges, blockwise_attention, blockwise_attention_forward
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.quantized import QuantizedTokens
from kvbench.cache.source import ConcatSource, RoPESource, TokenSource
from kvbench.cache.transient import PeakTransient
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.nuq import (
    kmeans_1d,
    masked_range,
    nearest_code,
    normalize,
    scale_zero,
    topk_outlier_mask,
)
from kvbench.quant.packing import pack
from kvbench.quant.rope import apply_rope

B, H_KV, D, G = 2, 3, 64, 32
RTOL = ATOL = 1e-5


def _affine(kind: str, x: torch.Tensor) -> tuple[TokenSource, torch.Tensor]:
    levels = {"channel2": 4, "channel2-nofold": 4, "channel3": 8, "token2": 4, "token2-fold": 4}.get(kind)
    levels = levels or {"token1.585": 3, "token3": 8}[kind]
    axis = "channel" if kind.startswith("channel") else "token"
    store = QuantizedTokens(levels, axis, G)
    store.append(x)
    if axis == "channel":
        src = PerChannelAffineSource.from_store(store, fold=kind != "channel2-nofold")
    else:
        src = PerTokenAffineSource.from_store(store, fold=kind == "token2-fold")
    return src, store.dequantize()


def _nuq(kind: str, x: torch.Tensor) -> tuple[TokenSource, torch.Tensor]:
    """KVQuant-style codes: normalized by a range, nearest nuq signpost, sparse outliers exact."""
    levels = 8
    b, h, t, d = x.shape
    if kind == "nuq-channel":  # fixed calibrated per-channel ranges [1, H, 1, D]
        scale, zero = scale_zero(
            x.amin(dim=(0, 2), keepdim=True) * 0.8, x.amax(dim=(0, 2), keepdim=True) * 0.8
        )
        mask = None
    else:  # per-token ranges with the largest-magnitude element of each token kept exactly
        mask = topk_outlier_mask(x, 0.02)
        scale, zero = scale_zero(*masked_range(x, mask))
    y = normalize(x, scale, zero)
    codebook = kmeans_1d(y[..., :16, :], levels, iters=20).half()
    codes = nearest_code(y, codebook.float())
    ref = codebook.float()[codes.long()] * scale.float() + zero.float()
    outliers = None
    if mask is not None:
        ib, ih, it, id_ = mask.nonzero(as_tuple=True)
        order = torch.argsort(it, stable=True)
        rows, cols = it[order].to(torch.int32), ((ib * h + ih) * d + id_)[order].to(torch.int16)
        outliers = (rows, cols, x[mask][order].half())
        ref[mask] = x[mask].half().float()
    src = CodebookSource(pack(codes, levels), levels, d, codebook, scale, zero, outliers=outliers)
    return src, ref


def _turbo(x: torch.Tensor) -> tuple[TokenSource, torch.Tensor]:
    """TurboQuant-style codes: ||x|| * Pi^T c[q] with Pi per head and a Lloyd-Max codebook."""
    levels, d = 4, x.shape[-1]
    rot = torch.stack([random_rotation(d, 11 + h) for h in range(x.shape[1])])
    centroids = torch.tensor(lloyd_max_codebook(levels, d)[0], dtype=torch.float32)
    norm = x.norm(dim=-1, keepdim=True)
    y = torch.einsum("bhtd,hed->bhte", x / norm, rot)
    codes = quantize_scalar(y, centroids)
    norm = norm.half()
    ref = torch.einsum("bhte,hed->bhtd", centroids[codes.long()], rot) * norm.float()
    return CodebookSource(pack(codes, levels), levels, d, centroids, scale=norm, rotation=rot), ref


def make_source(kind: str, x: torch.Tensor) -> tuple[TokenSource, torch.Tensor]:
    """A source of ``x [B, H_kv, T, D]`` stored as ``kind`` and the float32 tensor it reconstructs."""
    if kind == "fp16":
        return FullPrecisionSource(x.half()), x.half().float()
    if kind == "bf16":
        return FullPrecisionSource(x.bfloat16()), x.bfloat16().float()
    if kind == "fp32":
        return FullPrecisionSource(x), x
    if kind.startswith(("nuq", "turbo", "rope")) is False:
        return _affine(kind, x)
    if kind.startswith("nuq"):
        return _nuq(kind, x)
    if kind == "turbo":
        return _turbo(x)
    inner = FullPrecisionSource(x.half())
    positions = torch.arange(5, 5 + x.shape[-2])
    return RoPESource(inner, 10_000.0, first_position=5), apply_rope(x.half().float(), positions, 10_000.0)


KINDS = [
    "fp16",
    "bf16",
    "channel2",
    "channel2-nofold",
    "channel3",
    "token2",
    "token2-fold",
    "token1.585",
    "token3",
    "nuq-channel",
    "nuq-token",
    "turbo",
    "rope",
]


@pytest.mark.parametrize("kind", KINDS)
def test_read_equals_reconstruction_on_any_range(kind):
    torch.manual_seed(0)
    x = torch.randn(B, H_KV, 128, D) * 2
    src, ref = make_source(kind, x)
    assert isinstance(src, TokenSource)
    assert src.num_tokens == 128 and src.num_heads == H_KV
    # full, group-aligned, unaligned starts and stops, a single token, an empty range
    for start, stop in [(0, 128), (32, 96), (5, 70), (31, 33), (127, 128), (64, 64)]:
        got = src.read(start, stop)
        assert got.dtype == torch.float32 and got.shape == (B, H_KV, stop - start, D)
        torch.testing.assert_close(got, ref[..., start:stop, :], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_block_operations_equal_matmuls_on_the_reconstruction(kind):
    torch.manual_seed(1)
    x = torch.randn(B, H_KV, 128, D)
    src, ref = make_source(kind, x)
    q = torch.randn(B, H_KV, 6, D)
    for start, stop in [(0, 128), (32, 64), (7, 45)]:
        blk = ref[..., start:stop, :]
        torch.testing.assert_close(
            src.scores(q, start, stop), q @ blk.transpose(-1, -2), rtol=RTOL, atol=1e-4
        )
        p = torch.rand(B, H_KV, 6, stop - start)
        torch.testing.assert_close(src.mix(p, start, stop), p @ blk, rtol=RTOL, atol=1e-4)


def _reference(query, k_parts, v_parts, exact_k, exact_v, scaling, mask=None):
    """SDPA over the materialized cache: stored tokens, then the exact ones with a causal tail."""
    keys = torch.cat([*k_parts, exact_k.float()], dim=-2)
    values = torch.cat([*v_parts, exact_v.float()], dim=-2)
    n_rep = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(n_rep, 1), values.repeat_interleave(n_rep, 1)
    q, stored = query.shape[-2], keys.shape[-2] - exact_k.shape[-2]
    if mask is None:
        mask = torch.ones(q, stored + q, dtype=torch.bool)
        mask[:, stored:] = torch.ones(q, q, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(query.float(), keys, values, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


# (sink, key body, key residual, value body, value residual): keys and values split differently
LAYOUTS = {
    "residual-partly-full": (3, 128, 37, 160, 5),
    "empty-quantized-part": (3, 0, 20, 0, 20),
    "body-only": (0, 256, 0, 256, 0),
    "long": (1, 512, 100, 576, 36),
}


@functools.cache
def _cache(kind_k: str, kind_v: str, layout: str, seed: int = 0):
    """Sources of one layer's keys and values (sink | body | residual) and their dense parts; cached,
    since nothing here modifies them."""
    sink, kb, kr, vb, vr = LAYOUTS[layout]
    total = sink + kb + kr
    assert total == sink + vb + vr
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_KV, total, D, generator=g) * 1.5
    v = torch.randn(B, H_KV, total, D, generator=g)
    sources, dense = [], []
    for x, kind, body in ((k, kind_k, kb), (v, kind_v, vb)):
        parts = [FullPrecisionSource(x[..., :sink, :].half())]
        pieces = [x[..., :sink, :].half().float()]
        if body:
            src, ref = make_source(kind, x[..., sink : sink + body, :])
            parts.append(src)
            pieces.append(ref)
        parts.append(FullPrecisionSource(x[..., sink + body :, :].half()))
        pieces.append(x[..., sink + body :, :].half().float())
        sources.append(ConcatSource(parts))
        dense.append(pieces)
    return sources, dense


PAIRS = [
    ("channel2", "token2"),  # KIVI
    ("channel2-nofold", "token2-fold"),
    ("channel3", "token1.585"),
    ("fp16", "fp16"),
    ("bf16", "token3"),
    ("nuq-channel", "nuq-token"),  # KVQuant
    ("turbo", "turbo"),  # TurboQuant
    ("rope", "fp16"),
]


@pytest.mark.parametrize(("kind_k", "kind_v"), PAIRS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [32, 100, 1024])
@pytest.mark.parametrize(("q", "n_rep"), [(1, 3), (5, 3), (4, 1)])
def test_blockwise_equals_sdpa_over_materialized_cache(kind_k, kind_v, layout, block_size, q, n_rep):
    (keys, values), (k_parts, v_parts) = _cache(kind_k, kind_v, layout)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(B, H_KV * n_rep, q, D, generator=g)
    exact_k = torch.randn(B, H_KV, q, D, generator=g)
    exact_v = torch.randn(B, H_KV, q, D, generator=g)
    scaling = D**-0.5
    out = blockwise_attention(query, keys, values, scaling, block_size, exact_k, exact_v)
    ref = _reference(query, k_parts, v_parts, exact_k, exact_v, scaling)
    assert out.shape == (B, q, H_KV * n_rep, D) and out.dtype == query.dtype
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_bfloat16_query_returns_bfloat16():
    (keys, values), (k_parts, v_parts) = _cache("channel2", "token2", "residual-partly-full")
    query = torch.randn(B, 9, 1, D).bfloat16()
    ek, ev = torch.randn(B, H_KV, 1, D).bfloat16(), torch.randn(B, H_KV, 1, D).bfloat16()
    out = blockwise_attention(query, keys, values, D**-0.5, 64, ek, ev)
    ref = _reference(query.float(), k_parts, v_parts, ek.float(), ev.float(), D**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_prefill_without_stored_tokens_is_causal_attention():
    g = torch.Generator().manual_seed(2)
    query = torch.randn(1, 6, 7, D, generator=g)
    k, v = torch.randn(1, 2, 7, D, generator=g), torch.randn(1, 2, 7, D, generator=g)
    out = blockwise_attention(query, None, None, 0.125, exact_keys=k, exact_values=v)
    ref = F.scaled_dot_product_attention(
        query, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True, scale=0.125
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_stored_tokens_only():
    (keys, values), (k_parts, v_parts) = _cache("channel2", "token2", "residual-partly-full")
    query = torch.randn(B, 9, 1, D)
    out = blockwise_attention(query, keys, values, D**-0.5, 50)
    kd = torch.cat(k_parts, -2).repeat_interleave(3, 1)
    vd = torch.cat(v_parts, -2).repeat_interleave(3, 1)
    ref = F.scaled_dot_product_attention(query, kd, vd, scale=D**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("boolean", [True, False])
@pytest.mark.parametrize("heads", [1, 9])
def test_attention_mask_over_stored_and_current_tokens(boolean, heads):
    (keys, values), (k_parts, v_parts) = _cache("channel2", "token2", "residual-partly-full")
    q, stored = 3, keys.num_tokens
    g = torch.Generator().manual_seed(3)
    query = torch.randn(B, 9, q, D, generator=g)
    ek, ev = torch.randn(B, H_KV, q, D, generator=g), torch.randn(B, H_KV, q, D, generator=g)
    allowed = torch.rand(B, heads, q, stored + q, generator=g) > 0.3
    allowed[..., stored:] &= torch.ones(q, q, dtype=torch.bool).tril()
    allowed[..., stored] = True  # every row sees at least one token
    mask = allowed if boolean else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    out = blockwise_attention(query, keys, values, D**-0.5, 40, ek, ev, attention_mask=mask)
    ref = _reference(query, k_parts, v_parts, ek, ev, D**-0.5, mask=allowed)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_row_that_sees_nothing_returns_zero():
    keys = values = FullPrecisionSource(torch.randn(1, 1, 10, 4))
    mask = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    out = blockwise_attention(torch.randn(1, 1, 1, 4), keys, values, 0.5, 4, attention_mask=mask)
    assert torch.equal(out, torch.zeros(1, 1, 1, 4))


def test_forward_signature_matches_transformers():
    class Module:
        scaling = 0.25

    (keys, values), (k_parts, v_parts) = _cache("fp16", "fp16", "residual-partly-full")
    query = torch.randn(B, 3, 1, D)
    ek, ev = torch.randn(B, H_KV, 1, D), torch.randn(B, H_KV, 1, D)
    out, weights = blockwise_attention_forward(
        Module(), query, keys, values, None, exact_keys=ek, exact_values=ev
    )
    assert weights is None
    torch.testing.assert_close(out, _reference(query, k_parts, v_parts, ek, ev, 0.25), rtol=RTOL, atol=ATOL)


def test_blocks_are_cut_where_either_source_changes_parts():
    assert block_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert block_ranges(10, 4, [3, 3, 9]) == [(0, 3), (3, 7), (7, 9), (9, 10)]
    assert block_ranges(0, 4) == []
    (keys, values), _ = _cache("channel2", "token2", "residual-partly-full")
    assert keys.boundaries() == [3, 131] and values.boundaries() == [3, 163]


def test_concat_sources_align_key_and_value_blocks_by_token_index():
    x = torch.randn(1, 2, 12, 4)
    src = ConcatSource([FullPrecisionSource(x[..., :5, :]), None, FullPrecisionSource(x[..., 5:, :].half())])
    assert src.num_tokens == 12 and len(src.parts) == 2
    torch.testing.assert_close(src.read(3, 9), torch.cat([x[..., 3:5, :], x[..., 5:9, :].half().float()], -2))


# -- the scale-folding identities on hand-computed cases -------------------------------------------
def _tensor(rows, dtype=torch.float16):
    return torch.tensor(rows, dtype=dtype)[None, None]


@pytest.mark.parametrize("fold", [True, False])
def test_per_channel_fold_hand_computed(fold):
    # D = 2, G = 2: codes c0 = [1, 0], c1 = [2, 3]; per channel s = [0.5, 2], z = [-1, 1]
    # k0 = [-0.5, 1], k1 = [0, 7]; q = [1, 2]: q.k0 = 1.5, q.k1 = 14
    # folded: (q*s) = [0.5, 4]: (q*s).c0 + q.z = 0.5 + 1 = 1.5, (q*s).c1 + q.z = 13 + 1 = 14
    codes = pack(torch.tensor([[[[1, 0], [2, 3]]]], dtype=torch.uint8), 4)
    src = PerChannelAffineSource(codes, _tensor([[0.5, 2.0]]), _tensor([[-1.0, 1.0]]), 4, 2, 2, fold=fold)
    q = torch.tensor([[[[1.0, 2.0]]]])
    assert src.scores(q, 0, 2).flatten().tolist() == [1.5, 14.0]
    assert src.read(0, 2).flatten().tolist() == [-0.5, 1.0, 0.0, 7.0]


@pytest.mark.parametrize("fold", [True, False])
def test_per_token_fold_hand_computed(fold):
    # D = 2, G = 2: v0 = [1, 3] * 0.5 - 1 = [-0.5, 0.5], v1 = [2, 0] * 2 + 1 = [5, 1]
    # p = [0.25, 0.75]: sum p v = [3.625, 0.875]
    # folded: sum (p s) c = 0.125 [1, 3] + 1.5 [2, 0] = [3.125, 0.375]; sum p z = 0.5
    codes = pack(torch.tensor([[[[1, 3], [2, 0]]]], dtype=torch.uint8), 4)
    src = PerTokenAffineSource(codes, _tensor([[0.5], [2.0]]), _tensor([[-1.0], [1.0]]), 4, 2, 2, fold=fold)
    p = torch.tensor([[[[0.25, 0.75]]]])
    assert src.mix(p, 0, 2).flatten().tolist() == [3.625, 0.875]


def test_rotated_codebook_attends_in_the_rotated_space():
    # Pi = 90 degree turn; stored y = Pi x; codebook values c[q] = y / ||x|| (here exact)
    rot = torch.tensor([[[0.0, -1.0], [1.0, 0.0]]])
    x = torch.tensor([[[[3.0, 4.0]]]])  # ||x|| = 5, y = Pi x = [-4, 3], y / 5 = [-0.8, 0.6]
    codebook = torch.tensor([-0.8, 0.6])
    codes = pack(torch.tensor([[[[0, 1]]]], dtype=torch.uint8), 2)
    src = CodebookSource(codes, 2, 2, codebook, scale=_tensor([[5.0]]), rotation=rot)
    torch.testing.assert_close(src.read(0, 1), x)
    q = torch.tensor([[[[1.0, 2.0]]]])  # q . x = 11
    torch.testing.assert_close(src.scores(q, 0, 1), torch.tensor([[[[11.0]]]]))
    torch.testing.assert_close(src.mix(torch.tensor([[[[0.5]]]]), 0, 1), 0.5 * x)


# -- bad input ------------------------------------------------------------------------------------
def test_bad_input_names_the_problem():
    src = FullPrecisionSource(torch.randn(1, 2, 8, 4))
    q = torch.randn(1, 4, 1, 4)
    with pytest.raises(ValueError, match="block_size"):
        blockwise_attention(q, src, src, 1.0, block_size=0)
    with pytest.raises(ValueError, match="hold 8 tokens but values hold 7"):
        blockwise_attention(q, src, FullPrecisionSource(torch.randn(1, 2, 7, 4)), 1.0)
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        blockwise_attention(torch.randn(1, 3, 1, 4), src, src, 1.0)
    with pytest.raises(ValueError, match="outside the 8 stored tokens"):
        src.read(2, 9)
    with pytest.raises(ValueError, match="nothing to attend"):
        blockwise_attention(q, None, None, 1.0)
    with pytest.raises(ValueError, match="bytes per token"):
        PerTokenAffineSource(
            torch.zeros(1, 1, 2, 3, dtype=torch.uint8), *[torch.zeros(1, 1, 2, 2)] * 2, 4, 4, 8
        )
    with pytest.raises(ValueError, match="scale has shape"):
        PerChannelAffineSource(
            torch.zeros(1, 1, 4, 2, dtype=torch.uint8), *[torch.zeros(1, 1, 4, 8)] * 2, 4, 2, 8
        )
    with pytest.raises(ValueError, match="codebook must be"):
        CodebookSource(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), 4, 8, torch.zeros(3))


# -- transient memory -----------------------------------------------------------------------------
def test_transient_memory_grows_with_the_block_not_the_cache():
    peaks = {}
    for n in (1024, 4096):
        x = torch.randn(1, H_KV, n, D)
        keys, _ = make_source("channel2", x)
        values, _ = make_source("token2-fold", x)
        query = torch.randn(1, 9, 1, D)
        exact = torch.randn(1, H_KV, 1, D)
        with PeakTransient() as tracker:
            blockwise_attention(query, keys, values, D**-0.5, 256, exact, exact)
        peaks[n] = tracker.peak
    dequantized = 2 * H_KV * 4096 * D * 4  # float32 K and V of the 4096-token cache
    assert peaks[4096] < dequantized / 8
    assert peaks[4096] <= 1.1 * peaks[1024]


@pytest.mark.parametrize("mask_heads", [None, 1, 9])
@pytest.mark.parametrize("single_call", [True, False])
def test_replaced_entries_attend_their_replacements(mask_heads, single_call):
    """A store held in order whose last k entries replace k earlier ones (SpeCache's prefetched
    rows): the same attention as SDPA over the store with those rows overwritten, mask columns
    taken at the replaced positions; the single call (one scatter) and the block loop (positions
    form) agree."""
    g = torch.Generator().manual_seed(11)
    n, k, q = 70, 5, 2
    low_k, low_v = torch.randn(2, B, H_KV, n, D, generator=g).unbind(0)
    replaced = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(B * H_KV)]).view(B, H_KV, k)
    rows_k, rows_v = torch.randn(2, B, H_KV, k, D, generator=g).unbind(0)
    keys = ConcatSource([FullPrecisionSource(low_k), FullPrecisionSource(rows_k)])
    values = ConcatSource([FullPrecisionSource(low_v), FullPrecisionSource(rows_v)])
    query = torch.randn(B, 9, q, D, generator=g)
    ek, ev = torch.randn(2, B, H_KV, q, D, generator=g).unbind(0)
    mask = None
    if mask_heads is not None:
        mask = torch.rand(B, mask_heads, q, n + q, generator=g) > 0.3
        mask[..., n:] = torch.ones(q, q, dtype=torch.bool).tril()
    dense_k, dense_v = low_k.clone(), low_v.clone()
    index = replaced[..., None].expand(B, H_KV, k, D)
    dense_k.scatter_(2, index, rows_k)
    dense_v.scatter_(2, index, rows_v)
    ref = _reference(query, [dense_k], [dense_v], ek, ev, D**-0.5, mask=mask)
    out, _ = blockwise_attention_forward(
        None, query, keys, values, mask, scaling=D**-0.5, block_size=None if single_call else 16,
        exact_keys=ek, exact_values=ev, replaced=replaced,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
