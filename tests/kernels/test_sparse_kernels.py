"""KVQuant's compiled outlier corrections (``kvbench/kernels/cpu/sparse.cpp``: ``outlier_scores``,
``outlier_mix``) equal their plain-torch expressions (:func:`~kvbench.kernels.outliers._correct_scores`
and :func:`~kvbench.kernels.outliers._correct_mix` with ``module=None``) on random stores: every
code layout family (one-byte chunks of power-of-two and other level counts, base-L words, multi-byte
power-of-two chunks), fixed per-channel ranges (keys) and per-token fp16 ranges (values), with and
without RoPE, int16 and int32 columns, power-of-two and other head sizes, and more entries than one
task holds (so the token-boundary split and the partial sums run).

Tolerance: float32 reassociation only (``2e-5 * max|reference|``). Every failure message names its
case and seed.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.source import RoPESource
from kvbench.kernels import cpu as cpu_kernels
from kvbench.kernels.outliers import _correct_mix, _correct_scores
from kvbench.quant.packing import pack
from kvbench.quant.rope import cos_sin


@pytest.fixture(scope="module")
def module(compiled_kernels):
    return compiled_kernels


def close(got, want, where):
    err = (got - want).abs().max().item()
    bound = 2e-5 * max(want.abs().max().item(), 1e-6)
    assert err <= bound, f"{where}: max error {err:.3g} > {bound:.3g}"


def store(seed, levels, fixed, count, b=None, h=None, t=None, d=None):
    """A random dense-and-sparse part: codes as a view of a longer buffer (the doubling buffers'
    strides), ``count`` distinct outliers in token order, stored as the store holds them."""
    g = torch.Generator().manual_seed(seed)
    b = b or int(torch.randint(1, 3, (1,), generator=g))
    h = h or int(torch.randint(1, 4, (1,), generator=g))
    t = t or int(torch.randint(20, 400, (1,), generator=g))
    d = d or [64, 32, 48][int(torch.randint(0, 3, (1,), generator=g))]
    codes = torch.randint(0, levels, (b, h, t + 7, d), generator=g).to(torch.uint8)
    codes = pack(codes, levels)[:, :, :t]
    codebook = torch.randn(levels, generator=g).sort().values
    if fixed:
        scale = torch.rand(1, h, 1, d, generator=g) + 0.5
        zero = torch.randn(1, h, 1, d, generator=g)
    else:
        scale = (torch.rand(b, h, t + 3, 1, generator=g) + 0.5).half()[:, :, :t]
        zero = torch.randn(b, h, t + 3, 1, generator=g).half()[:, :, :t]
    count = min(count, t * b * h * d)
    flat = torch.randperm(t * b * h * d, generator=g)[:count].sort().values
    rows, cols = flat // (b * h * d), flat % (b * h * d)
    col_dtype = torch.int16 if b * h * d <= torch.iinfo(torch.int16).max else torch.int32
    outliers = (rows.to(torch.int32), cols.to(col_dtype), (torch.randn(count, generator=g) * 8).half())
    part = CodebookSource(codes, levels, d, codebook, scale, zero, outliers=outliers)
    return g, part, (b, h, t, d)


@pytest.mark.parametrize("levels", [2, 3, 4, 5, 8, 16, 17, 32])
@pytest.mark.parametrize("fixed", [True, False])
def test_outlier_corrections_equal_the_torch_expression(module, levels, fixed):
    for seed in range(3):
        count = [40, 900, 6000][seed]
        g, part, (b, h, t, d) = store(100 * levels + seed, levels, fixed, count)
        m = int(torch.randint(1, 5, (1,), generator=g))
        where = f"L={levels} fixed={fixed} b={b} h={h} t={t} d={d} m={m} n={count} seed={100 * levels + seed}"
        query = torch.randn(b, h, m, d, generator=g)
        weights = torch.rand(b, h, m, t, generator=g)
        base = torch.randn(b, h, m, t, generator=g)
        want = _correct_scores(base.clone(), part, query, None, None)
        close(_correct_scores(base.clone(), part, query, None, module), want, f"scores {where}")
        first = int(torch.randint(0, 50, (1,), generator=g))
        table = cos_sin(torch.arange(first + t + 3), d, 10000.0)
        rope = RoPESource(part, None, first_position=first, table=table)
        want = _correct_scores(base.clone(), part, query, rope, None)
        close(_correct_scores(base.clone(), part, query, rope, module), want, f"RoPE scores {where}")
        base = torch.randn(b, h, m, d, generator=g)
        want = _correct_mix(base.clone(), part, weights, None)
        close(_correct_mix(base.clone(), part, weights, module), want, f"mix {where}")


def test_int32_columns_and_float_values(module):
    """int32 columns (a store wider than int16 columns hold) and float32 values (not the store's,
    but accepted)."""
    g, part, (b, h, t, d) = store(7, 8, False, 5000, b=2, h=4, t=4200, d=64)
    rows, cols, vals = part.outliers
    part.outliers = (rows, cols.to(torch.int32), vals.float())
    query, weights = torch.randn(b, h, 2, d, generator=g), torch.rand(b, h, 2, t, generator=g)
    base = torch.randn(b, h, 2, t, generator=g)
    want = _correct_scores(base.clone(), part, query, None, None)
    close(_correct_scores(base.clone(), part, query, None, module), want, "int32 cols scores seed=7")
    base = torch.randn(b, h, 2, d, generator=g)
    close(_correct_mix(base.clone(), part, weights, module), _correct_mix(base.clone(), part, weights, None),
          "int32 cols mix seed=7")  # fmt: skip


def test_results_do_not_depend_on_the_thread_count(module):
    g, part, (b, h, t, d) = store(5, 8, True, 20000, b=1, h=3, t=800, d=64)
    query, weights = torch.randn(b, h, 3, d, generator=g), torch.rand(b, h, 3, t, generator=g)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            s = _correct_scores(torch.zeros(b, h, 3, t), part, query, None, module)
            x = _correct_mix(torch.zeros(b, h, 3, d), part, weights, module)
            got.append((s, x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), "seed=5"


def test_no_entries_change_nothing(module):
    g, part, (b, h, t, d) = store(3, 4, True, 10, b=1, h=2, t=30, d=32)
    rows, cols, vals = part.outliers
    part.outliers = (rows[:0], cols[:0], vals[:0])
    base = torch.randn(b, h, 2, t, generator=g)
    got = _correct_scores(base.clone(), part, torch.randn(b, h, 2, d, generator=g), None, module)
    assert torch.equal(got, base), "seed=3"


@pytest.mark.parametrize("levels", [2, 4, 8, 16])
@pytest.mark.parametrize("fixed", [True, False])
def test_rope_code_scores_equal_the_rope_source(module, levels, fixed):
    """The vector decoder of pre-RoPE codebook keys equals :class:`RoPESource` over the dense codes
    (no outliers: those are added by ``outlier_scores``), or declines (None) a layout it does not take."""
    vector_build = "-mavx2" in cpu_kernels.isa_flags()
    for seed in range(4):
        s = 1000 + 10 * levels + seed
        g, part, (b, h, t, d) = store(s, levels, fixed, 0, d=[64, 32, 128, 48][seed])
        part.outliers = None
        m = int(torch.randint(1, 6, (1,), generator=g))
        first = int(torch.randint(0, 50, (1,), generator=g))
        table = cos_sin(torch.arange(first + t + 3), d, 10000.0)
        rope = RoPESource(part, None, first_position=first, table=table)
        query = torch.randn(b, h, m, d, generator=g)
        rows = [0 if fixed else 1] * 2
        got = module.rope_code_scores(
            query, part.codes, part.table, part.scale, part.zero, levels, d, *rows, *table, first
        )
        where = f"L={levels} fixed={fixed} b={b} h={h} t={t} d={d} m={m} first={first} seed={s}"
        if not vector_build:
            # the vector decoder is AVX2 code: a build without it declines, and the caller reads
            # the part through the generic code_scores
            assert got is None, f"{where}: a build without AVX2 took the layout"
            continue
        assert got is not None, f"{where}: declined"
        close(got, rope.scores(query, 0, t), where)
        # without scale or zero
        bare = CodebookSource(part.codes, levels, d, part.table)
        args = (bare.codes, bare.table, None, None, levels, d, 0, 0, *table, first)
        got = module.rope_code_scores(query, *args)
        want = RoPESource(bare, None, first_position=first, table=table).scores(query, 0, t)
        close(got, want, f"bare {where}")


def test_rope_code_scores_decline_other_layouts(module):
    for levels, d in [(3, 64), (32, 64), (8, 40), (5, 64)]:
        g, part, (b, h, t, d) = store(9, levels, True, 0, b=1, h=2, t=40, d=d)
        table = cos_sin(torch.arange(t), d, 10000.0)
        query = torch.randn(b, h, 2, d, generator=g)
        args = (part.codes, part.table, part.scale, part.zero, levels, d, 0, 0, *table, 0)
        got = module.rope_code_scores(query, *args)
        assert got is None, f"L={levels} d={d} seed=9"
