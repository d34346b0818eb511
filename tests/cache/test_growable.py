"""Tests for kvbench.cache.growable: amortized appends, residual windows, grouped rows, accounting."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.cache.growable import GrowableTokens


def test_ten_thousand_single_token_appends_reallocate_logarithmically():
    buf = GrowableTokens(torch.float16)
    pieces = [torch.randn(1, 2, 1, 8) for _ in range(10_000)]
    for p in pieces:
        buf.append(p)
    assert len(buf) == buf.num_tokens == 10_000
    # 16, 32, ..., 16384: 11 allocations; anything linear in n would be thousands
    assert buf.reallocations <= 20
    assert buf.reallocations == 1 + math.ceil(math.log2(10_000 / 16))
    assert torch.equal(buf.view(), torch.cat(pieces, dim=-2).half())
    assert buf.capacity == 16_384


def test_bulk_append_larger_than_double_capacity():
    buf = GrowableTokens()
    buf.append(torch.randn(1, 1, 3, 4))
    big = torch.randn(1, 1, 100, 4)
    buf.append(big)
    assert buf.capacity == 128 and buf.reallocations == 2
    assert torch.equal(buf.view()[..., 3:, :], big)


def test_dtype_defaults_to_first_append_and_casts_later_ones():
    buf = GrowableTokens()
    buf.append(torch.ones(1, 1, 2, 4, dtype=torch.bfloat16))
    buf.append(torch.full((1, 1, 1, 4), 2.5, dtype=torch.float32))
    assert buf.view().dtype == torch.bfloat16
    assert buf.view()[0, 0, :, 0].tolist() == [1.0, 1.0, 2.5]


def test_uint8_codes_of_packed_width():
    buf = GrowableTokens(min_capacity=4)
    rows = [torch.randint(0, 256, (2, 3, t, 16), dtype=torch.uint8) for t in (5, 1, 1, 9)]
    for r in rows:
        buf.append(r)
    assert torch.equal(buf.view(), torch.cat(rows, dim=-2))


def test_residual_window_pops_and_moves_without_growing():
    # KIVI's value window: append one token, pop the oldest once more than R are held
    window, steps = 128, 5_000
    buf = GrowableTokens(torch.float32)
    reference = torch.randn(1, 2, steps, 4)
    popped = []
    for i in range(steps):
        buf.append(reference[..., i : i + 1, :])
        if len(buf) > window:
            popped.append(buf.pop_front(len(buf) - window))
    assert len(buf) == window
    assert torch.equal(buf.view(), reference[..., -window:, :])
    assert torch.equal(torch.cat(popped, dim=-2), reference[..., : steps - window, :])
    assert buf.capacity == 256 and buf.reallocations <= 6
    # each move copies at most half the buffer and happens once per >= capacity/2 - 1 appends
    assert buf.moves <= steps // (buf.capacity // 2 - 1) + 1


def test_popped_rows_survive_later_appends():
    buf = GrowableTokens(min_capacity=4)
    buf.append(torch.arange(4.0).reshape(1, 1, 4, 1))
    front = buf.pop_front(3)
    for i in range(10):
        buf.append(torch.full((1, 1, 1, 1), 100.0 + i))
    assert front.flatten().tolist() == [0.0, 1.0, 2.0]
    assert buf.view().flatten().tolist() == [3.0, *[100.0 + i for i in range(10)]]


def test_pop_everything_then_reuse():
    buf = GrowableTokens()
    buf.append(torch.ones(1, 1, 5, 2))
    before = buf.view()
    popped = buf.pop_front(5)
    assert len(buf) == 0 and buf.tensors() == [] and buf.bytes_in_use() == 0
    buf.append(torch.zeros(1, 1, 2, 2))
    assert torch.equal(buf.view(), torch.zeros(1, 1, 2, 2))
    # rows once written are never overwritten: the view and the popped rows still hold them
    assert torch.equal(before, torch.ones(1, 1, 5, 2)) and torch.equal(popped, torch.ones(1, 1, 5, 2))


def test_views_survive_appends_pops_and_compaction():
    # a layer snapshots its stores before a forward's append and attends them after it
    buf = GrowableTokens(min_capacity=8)
    snapshots = []
    for step in range(200):
        buf.append(torch.full((1, 2, 1, 3), float(step)))
        if len(buf) > 5:
            buf.pop_front(1)
        snapshots.append((buf.view(), buf.view().clone()))
    assert buf.moves > 0
    for view, copy in snapshots:
        assert torch.equal(view, copy)


def test_grouped_rows_count_tokens():
    # per-channel key statistics: one [B, H, 1, D] row per completed group of G tokens
    g = 32
    buf = GrowableTokens(torch.float16, tokens_per_row=g)
    rows = [torch.randn(1, 3, 1, 64) for _ in range(300)]
    for r in rows:
        buf.append(r)
    assert len(buf) == 300 and buf.num_tokens == 300 * g
    assert buf.reallocations <= 20
    assert torch.equal(buf.view(), torch.cat(rows, dim=-2).half())


def test_bytes_in_use_vs_reserved():
    buf = GrowableTokens(torch.float16)
    assert buf.bytes_in_use() == buf.bytes_reserved() == 0
    buf.append(torch.randn(2, 3, 17, 8))
    assert buf.bytes_in_use() == 2 * 3 * 17 * 8 * 2
    assert buf.bytes_reserved() == 2 * 3 * 32 * 8 * 2
    held = buf.tensors()
    assert len(held) == 1 and held[0].numel() * held[0].element_size() == buf.bytes_in_use()
    buf.pop_front(7)
    assert buf.bytes_in_use() == 2 * 3 * 10 * 8 * 2 and buf.bytes_reserved() == 2 * 3 * 32 * 8 * 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"tokens_per_row": 0}, "tokens_per_row"), ({"min_capacity": 0}, "min_capacity")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GrowableTokens(**kwargs)


def test_shape_mismatch_and_bad_pop():
    buf = GrowableTokens()
    buf.append(torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="does not match"):
        buf.append(torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="pop_front"):
        buf.pop_front(2)


def test_every_store_appends_in_amortized_time_over_10000_single_token_appends():
    """10,000 single-token decode steps through a KIVI layer: each buffer of each store reallocates
    O(log T) times (doubling), never once per step as concatenation did."""
    from kvbench.cache import memory_report
    from kvbench.methods import ModelShape, build_method

    shape = ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32)
    layer = (
        build_method({"name": "kivi", "bits": 2, "group_size": 32, "residual": 64})
        .new_cache(shape, torch.float32)
        .layers[0]
    )
    x = torch.randn(2, 1, 1, 10_000, 32)
    for t in range(10_000):
        layer.update(x[0, :, :, t : t + 1], x[1, :, :, t : t + 1])
    buffers = [layer.kq._codes, layer.kq._scale, layer.kq._zero, layer.vq._codes, layer.vq._scale]
    buffers += [layer.vq._zero, layer.k_res.buffer, layer.v_res.buffer]
    for buf in buffers[:6]:
        assert buf.reallocations <= 1 + math.ceil(math.log2(10_000 / 16))
    for buf in buffers[6:]:  # residual windows: a bounded capacity, compacted now and then
        assert buf.capacity <= 256 and buf.reallocations <= 5 and buf.moves <= 10_000 // 32
    report = memory_report([layer])
    held = report.total_bytes
    assert held < report.reserved_bytes <= 2 * held + 4096  # spare capacity, reported apart


def test_every_store_follows_the_storage_protocol():
    from kvbench.cache.dense_sparse import DenseSparseTokens
    from kvbench.cache.fp import FullPrecisionTokens
    from kvbench.cache.quantized import QuantizedTokens
    from kvbench.cache.rotated import HeadRotations, RotatedCodes
    from kvbench.cache.store import CodeStore, Store

    x = torch.randn(1, 2, 64, 32)
    stores = [
        QuantizedTokens(4, "channel", 32),
        QuantizedTokens(3, "token", 16),
        RotatedCodes(4, HeadRotations(0, 0)),
        DenseSparseTokens(4, torch.linspace(-1, 1, 4), 0.05),
    ]
    for store in stores:
        assert isinstance(store, CodeStore)
        store.append(x)
        assert len(store) == 64 and store.source().num_tokens == 64
        held = sum(t.numel() * t.element_size() for ts in store.held_tensors().values() for t in ts)
        assert held <= store.bytes_reserved() <= 2 * held + 4096
        # the source is a view: later appends do not change what it reads
        before = store.source()
        first = before.read(0, 64)
        store.append(torch.randn(1, 2, 64, 32))
        assert len(store) == 128 and torch.equal(before.read(0, 64), first)
    window = FullPrecisionTokens(torch.float16)
    assert isinstance(window, Store) and not isinstance(window, CodeStore)
    window.append(x)
    assert torch.equal(window.source().read(0, 64), x.half().float())
