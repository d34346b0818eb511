"""ReadKV's compiled plane kernels (``kvbench/kernels/cpu/planes.cpp``) and KVQuant's compiled
append equal their plain-torch references.

- ``allocate_prefix`` equals :func:`~kvbench.quant.progressive.allocate_prefix_bits` exactly on
  tie-free weights, and with ties spends the same budget for the same objective;
- ``plane_key_scores`` / ``plane_value_mix`` equal the prefix reconstruction
  (:func:`~kvbench.quant.progressive.prefix_reconstruct`) of the full codes followed by the dot
  product, to float32 reassociation, and read no plane beyond a row's prefix (flipping every bit of
  the unread planes leaves them unchanged);
- a whole ReadKV read through the kernels equals the blockwise torch read;
- ``dense_sparse_quantize_pack`` stores exactly the bytes the torch append stores.

Every failure message names its case and seed.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.bitplanes import BitPlaneTokens
from kvbench.cache.dense_sparse import DenseSparseTokens
from kvbench.methods.readkv import (
    PlaneStore,
    blockwise_query_adaptive_attention,
    budgets,
    compiled_query_adaptive_attention,
)
from kvbench.quant.nuq import kmeans_1d
from kvbench.quant.progressive import allocate_prefix_bits, prefix_reconstruct


@pytest.fixture(scope="module")
def kernels(compiled_kernels):
    return compiled_kernels


def close(got, want, where, rel=2e-5):
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    bound = rel * max(want.abs().max().item(), 1e-6)
    assert err <= bound, f"{where}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize(
    "shape,bits,budget",
    [((2, 3, 4, 64), 8, 256), ((1, 3, 3, 1000), 8, 4000), ((5, 17), 3, 20), ((4, 9), 4, 36),
     ((3, 40), 2, 1), ((2, 2, 7), 8, 0), ((2, 2, 7), 8, 56), ((2, 2, 7), 8, 500)],
)  # fmt: skip
def test_allocation_equals_the_reference_without_ties(kernels, shape, bits, budget):
    seed = sum(shape) + bits + budget
    g = torch.Generator().manual_seed(seed)
    # spread over many binades, as attention weights are
    w = torch.rand(shape, generator=g) * torch.exp2(-20 * torch.rand(shape, generator=g))
    want = allocate_prefix_bits(w, bits, budget)
    got = kernels.allocate_prefix(w, bits, budget)
    assert torch.equal(got, want), f"{shape} bits={bits} budget={budget} seed={seed}"


@pytest.mark.parametrize("budget", [5, 130, 300, 399])
def test_allocation_with_ties_spends_the_budget_for_the_same_objective(kernels, budget):
    g = torch.Generator().manual_seed(budget)
    w = torch.rand(3, 50, generator=g)
    w[:, ::3] = 0.0  # tied zero gains
    w[:, 1] = 2 * w[:, 4]  # w_1 2^-1 ties w_4's first gain
    w[:, 7] = 1e-42  # a subnormal weight: its gains round
    want = allocate_prefix_bits(w, 8, budget)
    got = kernels.allocate_prefix(w, 8, budget)
    objective = lambda p: (w * torch.pow(0.5, p.float())).sum(-1)  # noqa: E731
    where = f"budget={budget}"
    assert torch.equal(got.sum(-1), want.sum(-1)), where
    assert torch.equal(objective(got), objective(want)), where
    assert int(got.min()) >= 0 and int(got.max()) <= 8, where


def test_allocation_refuses_negative_weights(kernels):
    with pytest.raises(RuntimeError, match=">= 0"):
        kernels.allocate_prefix(torch.tensor([[0.5, -1.0]]), 4, 3)


@pytest.mark.parametrize("shape,dim", [((1, 3, 300, 2), -1), ((2, 3, 40, 64), -2), ((1, 2, 77, 4), -1)])
def test_rms_statistics_equal_torch_to_float_rounding(kernels, shape, dim):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    s = (torch.rand(shape, generator=g) * 2).half()
    want = s.float().pow(2).mean(dim).sqrt()
    close(kernels.plane_rms(s, dim), want, f"{shape} dim={dim}", rel=1e-6)


def stores(seed, bits, group, b, h, t, d):
    g = torch.Generator().manual_seed(seed)
    keys, values = BitPlaneTokens(bits, "channel", group), BitPlaneTokens(bits, "token", group)
    keys.append(torch.randn(b, h, t, d, generator=g))
    values.append(torch.randn(b, h, t, d, generator=g))
    return g, keys, values


CASES = [
    (8, 32, 64, 512, 3),
    (4, 32, 128, 256, 4),
    (2, 8, 64, 64, 1),
    (8, 64, 64, 1024, 9),
    (5, 32, 64, 96, 2),
]


@pytest.mark.parametrize("bits,group,d,t,m", CASES)
def test_plane_scores_and_mix_equal_the_prefix_reconstruction(kernels, bits, group, d, t, m):
    seed = bits * 1000 + t + m
    g, keys, values = stores(seed, bits, group, 1, 2, t, d)
    kc, vc = PlaneStore.of(keys), PlaneStore.of(values)
    query = torch.randn(1, 2, m, d, generator=g)
    pk = torch.randint(0, bits + 1, (1, 2, m, d), generator=g)
    pv = torch.randint(0, bits + 1, (1, 2, m, t), generator=g)
    weights = torch.softmax(torch.randn(1, 2, m, t, generator=g), -1)
    where = f"bits={bits} G={group} D={d} T={t} M={m} seed={seed}"
    s, z = kc.params(0, t)
    k_p = prefix_reconstruct(
        keys.codes()[:, :, None], s[:, :, None], z[:, :, None], bits, pk[:, :, :, None, :]
    )
    want = (k_p @ query[..., None])[..., 0] * 0.125
    got = kernels.plane_key_scores(query, kc.planes, kc.scale, kc.zero, pk, bits, group, 0.125)
    close(got, want, f"{where} scores")
    s, z = vc.params(0, t)
    v_p = prefix_reconstruct(values.codes()[:, :, None], s[:, :, None], z[:, :, None], bits, pv[..., None])
    want = (weights[..., None, :] @ v_p)[..., 0, :]
    got = kernels.plane_value_mix(weights, vc.planes, vc.scale, vc.zero, pv, bits, group, d)
    close(got, want, f"{where} mix")


def test_plane_kernels_read_no_plane_beyond_the_prefixes(kernels):
    bits, group, d, t, m = 6, 32, 64, 256, 3
    g, keys, values = stores(7, bits, group, 1, 2, t, d)
    kc, vc = PlaneStore.of(keys), PlaneStore.of(values)
    query = torch.randn(1, 2, m, d, generator=g)
    weights = torch.rand(1, 2, m, t, generator=g)
    pk = torch.randint(0, 4, (1, 2, m, d), generator=g)  # planes 4, 5 of keys never read
    pv = torch.randint(0, 3, (1, 2, m, t), generator=g)  # planes 3..5 of values never read
    scores = kernels.plane_key_scores(query, kc.planes, kc.scale, kc.zero, pk, bits, group, 1.0)
    mix = kernels.plane_value_mix(weights, vc.planes, vc.scale, vc.zero, pv, bits, group, d)
    kp, vp = kc.planes.clone(), vc.planes.clone()
    kp.view(1, 2, t // 8, bits, d)[..., 4:, :] ^= 0xFF
    vp.view(1, 2, t, bits, d // 8)[..., 3:, :] ^= 0xFF
    assert torch.equal(kernels.plane_key_scores(query, kp, kc.scale, kc.zero, pk, bits, group, 1.0), scores)
    assert torch.equal(kernels.plane_value_mix(weights, vp, vc.scale, vc.zero, pv, bits, group, d), mix)
    # and a read plane does change them
    kp.view(1, 2, t // 8, bits, d)[..., 0, :] ^= 0xFF
    assert not torch.equal(
        kernels.plane_key_scores(query, kp, kc.scale, kc.zero, pk, bits, group, 1.0), scores
    )


@pytest.mark.parametrize("bits,read_bits,m", [(8, 4, 3), (4, 1.5, 2), (2, 2, 1)])
def test_compiled_read_equals_the_blockwise_read(kernels, bits, read_bits, m):
    seed = bits * 10 + m
    d, t = 64, 320
    g, keys, values = stores(seed, bits, 32, 1, 3, t, d)
    kc, vc = PlaneStore.of(keys), PlaneStore.of(values)
    query = torch.randn(1, 3, m, d, generator=g)
    exact_k, exact_v = torch.randn(1, 3, 5, d, generator=g), torch.randn(1, 3, 5, d, generator=g)
    kb, vb = budgets(read_bits, 0.5, d, t)
    want = blockwise_query_adaptive_attention(
        query, kc, vc, bits, kb, vb, 0.125, exact_k, exact_v, block_size=128
    )
    got = compiled_query_adaptive_attention(kernels, query, kc, vc, bits, kb, vb, 0.125, exact_k, exact_v)
    where = f"bits={bits} read={read_bits} M={m} seed={seed}"
    assert torch.equal(got[1], want[1]), f"{where}: key prefixes"
    assert torch.equal(got[2], want[2]), f"{where}: value prefixes"
    close(got[0], want[0], f"{where} output")


@pytest.mark.parametrize("levels", [3, 4, 5, 8, 16])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("fixed", [False, True], ids=["online", "fixed"])
def test_dense_sparse_append_is_bit_identical_to_the_reference(kernels, levels, fraction, fixed):
    seed = levels * 100 + int(fraction * 100) + fixed
    g = torch.Generator().manual_seed(seed)
    codebook = kmeans_1d(torch.randn(4000, generator=g).clamp(-1, 1), levels)
    h, d = 3, 64
    rng = None
    if fixed:
        rng = ((torch.rand(h, d, generator=g) + 0.5).half(), (torch.randn(h, d, generator=g) * 0.1).half())
    ref = DenseSparseTokens(levels, codebook, fraction, rng, backend="torch")
    out = DenseSparseTokens(levels, codebook, fraction, rng, backend="auto")
    for t in (7, 1, 1, 33):
        x = torch.randn(2, h, t, d, generator=g) * 1.5
        x[0, 0, 0, :4] = 0.0  # tied magnitudes
        x[1, 1, -1] = 0.25  # a constant token: zero scale
        ref.append(x)
        out.append(x)
    where = f"levels={levels} fraction={fraction} fixed={fixed} seed={seed}"
    # outlier_layout auto on the CPU: the ragged threshold outliers the runs before the knob stored
    assert ref.outlier_layout == out.outlier_layout == "ragged", where
    for name in ("codes", "scale", "zero"):
        a, b = getattr(ref, name), getattr(out, name)
        assert (a is None and b is None) or torch.equal(a, b), f"{where}: {name}"
    a, b = ref.sparse(), out.sparse()
    assert (a is None) == (b is None), where
    for u, v in zip(a or (), b or (), strict=True):
        assert u.dtype == v.dtype and torch.equal(u, v), f"{where}: sparse entries"
