"""KVQuant's compiled codebook fit (``kvbench/kernels/cpu/lloyd.cpp``: ``lloyd_1d``) gives the bits of
the plain-torch reference :func:`kvbench.quant.nuq.kmeans_1d`: the same float32 midpoints, cells,
serial cell sums and stop. Exact equality, not a tolerance: a codebook that moved in its last bit
would move codes on their boundaries and with them the stored runs' rows.

Cases: normalized values as calibration makes them (clamped to [-1, 1], many at the clamp), heavy
ties and values exactly on a midpoint, a cell left empty, power-of-two and other level counts, one
value, and the sizes calibration fits (2^16 values).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import lloyd
from kvbench.quant.nuq import kmeans_1d, kmeans_start


@pytest.fixture(scope="module")
def module(compiled_kernels):
    return compiled_kernels


def normalized(seed: int, n: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).clamp(-1, 1)


CASES = {
    "normal": lambda s: normalized(s, 4096),
    "wide": lambda s: normalized(s, 4096, scale=4.0),  # a third of the values at the clamp
    "heavy_tail": lambda s: (torch.distributions.StudentT(2.0).sample((3000,)) / 3).clamp(-1, 1),
    "ties": lambda s: torch.randint(-4, 5, (2000,), generator=torch.Generator().manual_seed(s)) / 4.0,
    "calibration_size": lambda s: normalized(s, 2**16),
    "one_value": lambda s: torch.tensor([0.25]),
}


@pytest.mark.parametrize("levels", [2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_gives_the_reference_bits(module, case, levels):
    torch.manual_seed(0)
    for seed in range(3):
        v = CASES[case](seed).float().contiguous()
        want = kmeans_1d(v, levels)
        got = module.lloyd_1d(v, kmeans_start(v, levels).contiguous(), 100)
        assert torch.equal(got, want), f"{case}, L={levels}, seed {seed}: {got.tolist()} != {want.tolist()}"


@pytest.mark.parametrize("iters", [0, 1, 2, 5])
def test_the_iteration_cap_is_the_references(module, iters):
    v = normalized(7, 5000)
    start = kmeans_start(v, 8).contiguous()
    assert torch.equal(module.lloyd_1d(v, start, iters), kmeans_1d(v, 8, iters=iters))


def test_a_hand_computed_fit(module):
    # two clusters: Lloyd ends with each signpost the mean of its cluster
    v = torch.tensor([-1.0, -0.5, -0.75, 0.5, 1.0, 0.75])
    got = module.lloyd_1d(v, kmeans_start(v, 2).contiguous(), 100)
    assert got.tolist() == [-0.75, 0.75]


def test_an_empty_cell_keeps_its_signpost(module):
    # start [-1, 0, 1]: no value is nearer 0 than the others' after the first step moves them
    v = torch.tensor([-1.0, -1.0, -0.9, 0.9, 1.0, 1.0])
    start = torch.tensor([-1.0, 0.0, 1.0])
    got = module.lloyd_1d(v, start, 100)
    assert got.tolist() == pytest.approx([-0.9666666, 0.0, 0.9666666])
    assert torch.equal(got, kmeans_1d_from(v, start))


def kmeans_1d_from(v, start, iters=100):
    """The reference's loop from a chosen start (kmeans_1d starts from the quantiles)."""
    from kvbench.quant import nuq

    original = nuq.kmeans_start
    nuq.kmeans_start = lambda _v, _levels: start.clone()
    try:
        return nuq.kmeans_1d(v, start.numel(), iters)
    finally:
        nuq.kmeans_start = original


def test_the_dispatcher_falls_back_to_the_reference(monkeypatch):
    v = normalized(3, 3000)
    want = kmeans_1d(v, 4)
    assert torch.equal(lloyd.kmeans_1d(v, 4), want)
    monkeypatch.setattr(lloyd, "cpu_kernels", lambda: None)
    assert torch.equal(lloyd.kmeans_1d(v, 4), want)
    assert torch.equal(lloyd.kmeans_1d(torch.empty(0), 4), torch.linspace(-1, 1, 4))


@pytest.mark.parametrize("levels", [17, 32, 300])
def test_more_signposts_than_lanes(module, levels):
    v = normalized(11, 6000)
    assert torch.equal(module.lloyd_1d(v, kmeans_start(v, levels).contiguous(), 100), kmeans_1d(v, levels))


def test_a_value_not_finite_goes_to_the_reference():
    # the kernel counts cells by compares, which place a NaN otherwise than bucketize does
    v = normalized(5, 1000)
    v[3] = float("nan")
    got, want = lloyd.kmeans_1d(v, 4), kmeans_1d(v, 4)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
