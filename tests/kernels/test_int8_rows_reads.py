"""Int8 per-token rows (kvbench/cache/int8_rows.py) read by both backends' kernels through the one
registration in their own file (the codebook reads at 256 levels over the same bytes), equal to the
part's torch reference."""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.int8_rows import Int8RowTokens


def _int8_part(t=75, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = Int8RowTokens()
    store.append(torch.randn(2, 2, t, d, generator=g) * (0.5 + 4 * torch.rand(d, generator=g)))
    return store.source()


def _close(got, want):
    assert got is not None and got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 4])
def test_int8_rows_read_by_the_compiled_kernels(compiled_kernels, rows):
    from kvbench.kernels.cpu.parts import CompiledReader

    part, reader = _int8_part(), CompiledReader(compiled_kernels)
    g = torch.Generator().manual_seed(1)
    query, weights = torch.randn(2, 2, rows, 64, generator=g), torch.rand(2, 2, rows, 75, generator=g)
    _close(reader.scores(part, query), part.scores(query, 0, 75))
    _close(reader.mix(part, weights), part.mix(weights, 0, 75))


def test_int8_rows_read_by_triton():
    from kvbench.kernels.triton_parts import TritonReader, covers

    part = _int8_part(t=53, seed=2)
    assert covers(part)
    g = torch.Generator().manual_seed(3)
    query, weights = torch.randn(2, 2, 4, 64, generator=g), torch.rand(2, 2, 4, 53, generator=g)
    reader = TritonReader(strict=True)
    _close(reader.scores(part, query), part.scores(query, 0, 53))
    _close(reader.mix(part, weights), part.mix(weights, 0, 53))
