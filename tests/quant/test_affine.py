"""Tests for kvbench.quant.affine against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.quant.affine import (
    affine_params,
    bits_for_levels,
    dequantize,
    dequantize_grouped,
    fake_quantize_grouped,
    levels_for_bits,
    quantize,
    quantize_grouped,
)


@pytest.mark.parametrize(
    ("bits", "levels"),
    [(1, 2), (1.585, 3), (2, 4), (2.322, 5), (2.585, 6), (3, 8), (4, 16), (8, 256), (2.807, 7)],
)
def test_levels_for_bits_table(bits, levels):
    assert levels_for_bits(bits) == levels


@pytest.mark.parametrize("bits", [0.5, 9, 2.1, 0, -1, 1.5, float("nan"), float("inf"), 1e9])
def test_levels_for_bits_rejects(bits):
    with pytest.raises(ConfigError) as info:
        levels_for_bits(bits, key="k_bits")
    assert "k_bits" in str(info.value)
    assert "2..256" in str(info.value)


def test_bits_for_levels():
    assert bits_for_levels(8) == 3.0
    assert bits_for_levels(3) == pytest.approx(1.58496, abs=1e-5)
    for levels in range(2, 257):
        assert levels_for_bits(round(bits_for_levels(levels), 3)) == levels


def test_minmax_hand_case_four_levels():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    scale, zero = affine_params(x, 4)
    assert scale.shape == (1,) and zero.shape == (1,)
    assert scale.item() == 1.0 and zero.item() == 0.0
    codes = quantize(x, scale, zero, 4)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0, 1, 2, 3]
    assert dequantize(codes, scale, zero).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_minmax_hand_case_two_levels():
    x = torch.tensor([-1.0, 0.2, 0.5, 3.0])
    scale, zero = affine_params(x, 2)
    assert scale.item() == 4.0 and zero.item() == -1.0
    codes = quantize(x, scale, zero, 2)
    assert codes.tolist() == [0, 0, 0, 1]
    assert dequantize(codes, scale, zero).tolist() == [-1.0, -1.0, -1.0, 3.0]


def test_specache_zero_point_hand_case():
    # min=-1, max=3: levels at (3min+max)/4 = 0 and (min+3max)/4 = 2, threshold at the midpoint 1.
    x = torch.tensor([-1.0, 0.5, 0.99, 1.01, 2.5, 3.0])
    scale, zero = affine_params(x, 2, zero_point="specache")
    assert zero.item() == 0.0 and scale.item() == 2.0
    codes = quantize(x, scale, zero, 2)
    assert codes.tolist() == [0, 0, 0, 1, 1, 1]
    assert dequantize(codes, scale, zero).tolist() == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0]


def test_specache_needs_two_levels():
    with pytest.raises(ConfigError) as info:
        affine_params(torch.randn(8), 4, zero_point="specache")
    assert "zero_point" in str(info.value)


def test_unknown_zero_point():
    with pytest.raises(ConfigError) as info:
        affine_params(torch.randn(8), 4, zero_point="mean")
    assert "zero_point" in str(info.value)
    assert "minmax, specache" in str(info.value)


@pytest.mark.parametrize("zero_point", ["minmax", "specache"])
def test_constant_group_is_exact(zero_point):
    x = torch.full((3, 8), 0.7)
    x[1] = -2.5
    scale, zero = affine_params(x, 2, zero_point)
    codes = quantize(x, scale, zero, 2)
    assert codes.eq(0).all()
    xhat = dequantize(codes, scale, zero)
    assert torch.isfinite(xhat).all()
    assert torch.equal(xhat, x)
    xhat_grouped = fake_quantize_grouped(x, 2, "token", None, zero_point, param_dtype=torch.float32)
    assert torch.equal(xhat_grouped, x)


def test_round_half_up():
    # s=1, z=0: 0.5 -> 1, 1.5 -> 2, 2.5 -> 3 (torch.round would give 0, 2, 2).
    x = torch.tensor([0.5, 1.5, 2.5, 0.49])
    scale, zero = torch.tensor([1.0]), torch.tensor([0.0])
    assert quantize(x, scale, zero, 4).tolist() == [1, 2, 3, 0]


def test_quantize_clamps():
    scale, zero = torch.tensor([1.0]), torch.tensor([0.0])
    assert quantize(torch.tensor([-3.0, 9.0]), scale, zero, 4).tolist() == [0, 3]


@pytest.mark.parametrize(
    ("axis", "group_size", "param_shape"),
    [
        ("token", 4, (2, 3, 8, 2)),
        ("token", None, (2, 3, 8, 1)),
        ("channel", 4, (2, 3, 2, 8)),
        ("channel", None, (2, 3, 1, 8)),
    ],
)
def test_grouped_shapes(axis, group_size, param_shape):
    x = torch.randn(2, 3, 8, 8)
    codes, scale, zero = quantize_grouped(x, 4, axis, group_size)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert scale.shape == param_shape and zero.shape == param_shape
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    assert dequantize_grouped(codes, scale, zero, axis, group_size).shape == x.shape


def test_grouped_bad_group_sizes():
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match="group_size"):
        quantize_grouped(x, 4, "token", 3)
    with pytest.raises(ValueError, match="group_size"):
        quantize_grouped(x, 4, "channel", 4)
    with pytest.raises(ValueError):
        quantize_grouped(x, 4, "head", 2)


def test_grouped_hand_case_token_vs_channel():
    # Rows are tokens, columns channels.
    x = torch.tensor([[0.0, 1.0, 4.0], [2.0, 3.0, 5.0]])
    per_token = fake_quantize_grouped(x, 2, "token", None)
    per_channel = fake_quantize_grouped(x, 2, "channel", None)
    # Token 0: min 0, max 4, s=4: 1 -> floor(0.25 + 0.5) = 0 -> 0.
    # Token 1: min 2, max 5, s=3: 3 -> floor(1/3 + 0.5) = 0 -> 2.
    assert per_token.tolist() == [[0.0, 0.0, 4.0], [2.0, 2.0, 5.0]]
    # Each channel holds just two values, which two levels represent exactly.
    assert per_channel.tolist() == [[0.0, 1.0, 4.0], [2.0, 3.0, 5.0]]


def test_grouped_channel_groups_hand_case():
    # T=4 tokens, groups of 2 tokens, D=1; each pair is reconstructed from its own min/max.
    x = torch.tensor([[0.0], [1.0], [10.0], [10.5]])
    codes, scale, zero = quantize_grouped(x, 2, "channel", 2)
    assert scale.tolist() == [[1.0], [0.5]]
    assert zero.tolist() == [[0.0], [10.0]]
    assert codes.tolist() == [[0], [1], [0], [1]]
    # Per token with D=1 every group is constant: code 0, exact.
    codes, scale, zero = quantize_grouped(x, 2, "token", 1)
    assert codes.eq(0).all() and scale.eq(0).all()
    assert zero.float().flatten().tolist() == [0.0, 1.0, 10.0, 10.5]


def _broadcast(param, axis, group_size, like):
    """A grouped param (scale or zero layout) expanded to ``like``'s shape ``[..., T, D]``, float32."""
    codes = torch.zeros_like(like, dtype=torch.uint8)
    return dequantize_grouped(codes, torch.zeros_like(param), param, axis, group_size)


@pytest.mark.parametrize("levels", [2, 3, 4, 5, 6, 8, 16])
@pytest.mark.parametrize(
    ("axis", "group_size"), [("token", 16), ("channel", 8), ("token", None), ("channel", None)]
)
def test_reconstruction_error_bound(levels, axis, group_size):
    x = torch.randn(2, 4, 32, 64) * 3 + 1
    codes, scale16, zero16 = quantize_grouped(x, levels, axis, group_size)
    xhat = dequantize_grouped(codes, scale16, zero16, axis, group_size)
    _, scale32, zero32 = quantize_grouped(x, levels, axis, group_size, param_dtype=torch.float32)
    s16, z16 = _broadcast(scale16, axis, group_size, x), _broadcast(zero16, axis, group_size, x)
    s32, z32 = _broadcast(scale32, axis, group_size, x), _broadcast(zero32, axis, group_size, x)
    # Rounding the params to fp16 moves the grid ends by at most |dz| + (L-1)|ds|; values beyond
    # them are clamped. 1e-5 covers float32 arithmetic.
    slack = (z16 - z32).abs() + (levels - 1) * (s16 - s32).abs() + 1e-5
    err = (x - xhat).abs()
    assert torch.isfinite(xhat).all()
    assert torch.all(err <= s16 / 2 + slack)
    # The bound is not vacuous: the fp16 slack is far below the step.
    assert torch.all(slack < s16 / 20)
    # And the error does reach a good part of the half step.
    assert err.max() > 0.4 * s16.max() / 2


@pytest.mark.parametrize(("axis", "group_size"), [("token", 8), ("channel", 4)])
@pytest.mark.parametrize("levels", [2, 3, 5, 16])
def test_params_stored_fp16_and_codes_consistent(axis, group_size, levels):
    x = torch.randn(3, 16, 32) * 7
    codes, scale, zero = quantize_grouped(x, levels, axis, group_size)
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    # Storing and reloading the three tensors reproduces the quantizer's reconstruction exactly.
    stored = (codes.clone(), scale.clone(), zero.clone())
    expected = fake_quantize_grouped(x, levels, axis, group_size)
    assert torch.equal(dequantize_grouped(*stored, axis, group_size), expected)
    # The codes are those of the stored fp16 grid: recompute them by hand from the stored params.
    if axis == "token":
        xg = x.reshape(3, 16, 32 // group_size, group_size)
        recomputed = quantize(xg, scale.float().unsqueeze(-1), zero.float().unsqueeze(-1), levels)
    else:
        xg = x.reshape(3, 16 // group_size, group_size, 32)
        recomputed = quantize(xg, scale.float().unsqueeze(-2), zero.float().unsqueeze(-2), levels)
    assert torch.equal(codes, recomputed.reshape(3, 16, 32))


def test_codes_use_fp16_params():
    # min = 1/3 is not an fp16 number: fp16 gives 0.333251953125, so the 1-bit threshold moves from
    # 0.83333 (float32 grid) to 0.83325 (fp16 grid). 0.8333 lies between the two.
    a = torch.tensor(1.0 / 3.0).item()
    x = torch.tensor([[a, 0.8333, a + 1.0]])
    codes16, scale16, zero16 = quantize_grouped(x, 2, "token", None)
    codes32, _, _ = quantize_grouped(x, 2, "token", None, param_dtype=torch.float32)
    assert zero16.item() == 0.333251953125 and scale16.item() == 1.0
    assert codes16.tolist() == [[0, 1, 1]]
    assert codes32.tolist() == [[0, 0, 1]]
