"""Int8 per-token rows (kvbench/cache/int8_rows.py) against a plain dequantize reference written
out here: what is held, what reads back, and attention over it."""

from __future__ import annotations

import torch

from kvbench.cache.blockwise import blockwise_attention
from kvbench.cache.int8_rows import Int8RowSource, Int8RowTokens


def reference(x: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax int8 per (token, head), scale held in fp16: ``round(x / s) * s``."""
    s = (x.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    q = torch.round(x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-127, 127)
    return q * s


def rows(t: int, seed: int, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, t, d, generator=g) * (0.5 + 4 * torch.rand(d, generator=g))


def test_store_holds_int8_codes_and_fp16_scales_and_reads_back_the_reference():
    store = Int8RowTokens()
    a, b = rows(37, 0), rows(5, 1)
    a[0, 1, 3] = 0  # an all-zero row: scale 0, codes 0, reads back 0
    store.append(a)
    store.append(b)
    store.append(b[..., :0, :])  # nothing
    assert len(store) == 42
    held = store.held_tensors()
    assert held["codes"][0].dtype == torch.int8 and held["codes"][0].shape == (2, 3, 42, 64)
    assert held["scales"][0].dtype == torch.float16 and held["scales"][0].shape == (2, 3, 42, 1)
    assert held["codes"][0].min() >= -127
    want = reference(torch.cat([a, b], dim=-2))
    assert torch.equal(store.dequantize(), want)
    assert torch.equal(store.source().read(0, 42), want)
    assert torch.equal(store.source().read(30, 40), want[..., 30:40, :])
    assert not store.dequantize()[0, 1, 3].any()
    # each element within half a step of the original
    x = torch.cat([a, b], dim=-2)
    assert ((store.dequantize() - x).abs() <= store.scale.float() / 2 + 1e-6).all()


def test_attention_over_int8_rows_equals_attention_over_the_reference():
    keys, values = Int8RowTokens(), Int8RowTokens()
    k, v = rows(50, 2), rows(50, 3)
    keys.append(k)
    values.append(v)
    query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(4)).expand(2, 6, 1, 64)
    got = blockwise_attention(query, keys.source(), values.source(), 0.125, block_size=16)
    rk, rv = reference(k), reference(v)
    logits = torch.matmul(query.reshape(2, 3, 2, 64), rk.transpose(-1, -2)) * 0.125
    want = torch.matmul(logits.softmax(-1), rv).reshape(2, 6, 1, 64).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bytes_are_a_byte_per_value_plus_a_scale_per_row():
    store = Int8RowTokens()
    store.append(rows(16, 5))
    held = sum(t.numel() * t.element_size() for ts in store.held_tensors().values() for t in ts)
    assert held == 2 * 3 * 16 * (64 + 2)
    assert store.quantized_values() == 2 * 3 * 16 * 64


def test_source_refuses_what_is_not_int8_rows():
    import pytest

    with pytest.raises(ValueError, match="int8"):
        Int8RowSource(torch.zeros(1, 1, 2, 4, dtype=torch.uint8), torch.zeros(1, 1, 2, 1).half())
    with pytest.raises(ValueError, match="scale"):
        Int8RowSource(torch.zeros(1, 1, 2, 4, dtype=torch.int8), torch.zeros(1, 1, 2, 4).half())
