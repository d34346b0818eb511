"""TurboQuant-MSE: the Lloyd-Max codebook of a sphere coordinate, the rotation, the paper's distortion
numbers, and the layer's storage."""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.special import beta as beta_fn

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.packing import packed_bits_per_code, packed_length

D = 128
# TurboQuant's measured D_mse for b = 1..4 bits (the paper's rounded values).
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def density(dim):
    norm = 1 / beta_fn(0.5, (dim - 1) / 2)
    return lambda t: norm * (1 - t * t) ** ((dim - 3) / 2)


def test_one_bit_centroids_are_plus_minus_mean_abs_coordinate():
    f = density(D)
    mean_abs = 2 * quad(lambda t: t * f(t), 0, 1, epsabs=1e-13, epsrel=1e-12)[0]
    c, b = lloyd_max_codebook(2, D)
    assert c[1] == pytest.approx(mean_abs, abs=1e-6) and c[0] == pytest.approx(-mean_abs, abs=1e-6)
    assert b[0] == pytest.approx(0, abs=1e-15)
    assert c[1] == pytest.approx(math.sqrt(2 / (math.pi * D)), rel=0.02)  # high-d limit


@pytest.mark.parametrize("levels", [2, 3, 4, 5, 6, 8, 16])
def test_codebook_is_a_symmetric_ascending_lloyd_fixed_point(levels):
    c, b = lloyd_max_codebook(levels, D)
    assert c.shape == (levels,) and b.shape == (levels - 1,)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-15)
    np.testing.assert_allclose(b, (c[1:] + c[:-1]) / 2, rtol=0, atol=1e-15)
    f = density(D)
    edges = [-1.0, *b, 1.0]
    for i in range(levels):
        lo, hi = edges[i], edges[i + 1]
        mass = quad(f, lo, hi, epsabs=1e-14, epsrel=1e-12)[0]
        moment = quad(lambda t: t * f(t), lo, hi, epsabs=1e-14, epsrel=1e-12)[0]
        assert c[i] == pytest.approx(moment / mass, abs=1e-8)


def test_large_level_counts_converge():
    c, _ = lloyd_max_codebook(256, 64)
    assert c.shape == (256,) and np.all(np.diff(c) > 0)


def test_quantize_scalar_picks_the_nearest_centroid():
    c = torch.tensor([-1.0, 0.0, 2.0])
    y = torch.tensor([-3.0, -0.51, -0.49, 0.99, 1.01, 5.0])
    assert quantize_scalar(y, c).tolist() == [0, 0, 1, 1, 2, 2]


def test_rotation_is_orthogonal_and_deterministic_per_seed():
    a, b, other = random_rotation(64, 7), random_rotation(64, 7), random_rotation(64, 8)
    assert torch.allclose(a @ a.T, torch.eye(64), atol=1e-5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, other, atol=1e-2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_measured_mse_is_below_the_bound_and_near_the_paper(bits):
    g = torch.Generator().manual_seed(bits)
    u = torch.randn(2000, D, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    pi = random_rotation(D, 123, dtype=torch.float64)
    c = torch.tensor(lloyd_max_codebook(2**bits, D)[0])
    y = u @ pi.T
    u_hat = c[quantize_scalar(y, c).long()] @ pi
    mse = ((u - u_hat) ** 2).sum(-1).mean().item()
    assert mse <= math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.15)


def tq_layer(dim=D, heads=2, **overrides):
    shape = ModelShape(num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=dim)
    method = build_method({"name": "turboquant", "bits": 2, **overrides})
    method.config.check_model(shape)
    return method.make_layer(0, shape, torch.float32)


def test_layer_stores_fp16_norms_and_reconstructs_norm_times_rotated_centroids():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 40, D) * torch.linspace(0.5, 30, 40)[:, None]
    v = torch.randn(1, 2, 40, D)
    layer = tq_layer()
    layer.update(k, v)
    assert layer.kq.codes.shape == (1, 2, 40, packed_length(D, 4)) and layer.kq.codes.dtype == torch.uint8
    assert layer.kq.norms.dtype == torch.float16
    torch.testing.assert_close(layer.kq.norms.float(), k.norm(dim=-1, keepdim=True), rtol=2**-11, atol=0)
    rk, _ = layer.read()
    # x_hat = ||x|| Pi^T c[q]: its norm is the stored norm times ||c[q]|| (rotation keeps norms)
    c = torch.tensor(lloyd_max_codebook(4, D)[0], dtype=torch.float32)
    for h in range(2):
        y = k[0, h] / k[0, h].norm(dim=-1, keepdim=True) @ layer.rotations.matrices[h].T
        cq = c[quantize_scalar(y, c).long()]
        want = layer.kq.norms[0, h].float() * (cq @ layer.rotations.matrices[h])
        torch.testing.assert_close(rk[0, h], want, rtol=1e-5, atol=1e-5)
        ratio = rk[0, h].norm(dim=-1) / layer.kq.norms[0, h, :, 0].float()
        torch.testing.assert_close(ratio, cq.norm(dim=-1), rtol=1e-5, atol=0)
    rel = (rk - k).norm(dim=-1) ** 2 / k.norm(dim=-1) ** 2
    assert 0.08 < rel.mean().item() < 0.16  # ~ D_mse(2 bits) = 0.117


def test_effective_bits_are_packed_code_bits_plus_norm_bits():
    for bits, levels in ((2, 4), (1.585, 3)):
        layer = tq_layer(bits=bits)
        layer.update(torch.randn(1, 2, 30, D), torch.randn(1, 2, 30, D))
        layer.update(torch.randn(1, 2, 1, D), torch.randn(1, 2, 1, D))
        report = memory_report([layer])
        n = report.n_values
        assert n == 2 * 2 * 31 * D and report.quantized_values == n
        assert report.bytes_by_component["seeds"] == 8
        assert report.bytes_by_component["residual"] == 0
        assert report.nominal_code_bits == pytest.approx(math.log2(levels))
        code_bits = 8 * packed_length(D, levels) / D
        assert code_bits == pytest.approx(packed_bits_per_code(levels), rel=0.02)
        assert report.code_bits == code_bits
        assert report.effective_bits == pytest.approx(code_bits + 16 / D + 64 / n, rel=1e-12)


def test_residual_window_keeps_the_newest_tokens_exact():
    k, v = torch.randn(2, 1, 2, 50, D).unbind(0)
    layer = tq_layer(residual=16, fp_dtype="auto")
    layer.update(k[:, :, :40], v[:, :, :40])
    for t in range(40, 50):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert (len(layer.kq), len(layer.k_res), len(layer.vq)) == (34, 16, 34)
    rk, rv = layer.read()
    assert torch.equal(rk[:, :, 34:], k[:, :, 34:]) and torch.equal(rv[:, :, 34:], v[:, :, 34:])
    assert not torch.allclose(rk[:, :, :34], k[:, :, :34], atol=1e-2)


def test_streaming_equals_one_shot_and_key_value_bits_apart():
    k, v = torch.randn(2, 1, 2, 12, 64).unbind(0)
    one = tq_layer(dim=64, key_bits=3, value_bits=1)
    one.update(k, v)
    many = tq_layer(dim=64, key_bits=3, value_bits=1)
    for t in range(12):
        many.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert (one.kq.levels, one.vq.levels) == (8, 2)
    assert torch.equal(one.kq.codes, many.kq.codes) and torch.equal(one.vq.codes, many.vq.codes)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"bits": 9}, "bits"),
        ({"key_bits": 9}, "method.key_bits"),
        ({"backend": "triton"}, "method.backend"),
        ({"residual": -1}, "method.residual"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "turboquant", "bits": 2, **overrides})
    assert err.value.key == key
    if key == "method.backend":
        assert "only torch" in str(err.value)
