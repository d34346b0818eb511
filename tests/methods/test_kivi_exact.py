"""KIVI's codes equal its released code's arithmetic bit for bit, on fp16 and fp32 inputs, ties included.

The reference below is written from the released quantizer's description (not imported): per group,
``mn = min``, ``mx = max`` and ``scale = (mx - mn) / (2^B - 1)`` in the input's dtype; the codes are
``(x - mn) / scale`` in that dtype, clamped to ``[0, 2^B - 1]``, then rounded half to even; scale
and ``mn`` are kept in the input's dtype. Keys are grouped per channel over G consecutive tokens,
values per token over G consecutive channels.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.quant.affine import quantize_grouped
from kvbench.quant.packing import unpack


def released(x: torch.Tensor, bits: int, group: int, axis: str):
    """(codes int64, scale, mn) of the released arithmetic; ``x [B, H, T, D]`` in any float dtype."""
    top = 2**bits - 1
    b, h, t, d = x.shape
    if axis == "channel":  # keys: statistics over G tokens of one channel
        g = x.reshape(b, h, t // group, group, d)
        mn, mx = g.min(dim=-2, keepdim=True).values, g.max(dim=-2, keepdim=True).values
    else:  # values: statistics over G channels of one token
        g = x.reshape(b, h, t, d // group, group)
        mn, mx = g.min(dim=-1, keepdim=True).values, g.max(dim=-1, keepdim=True).values
    scale = (mx - mn) / top
    codes = ((g - mn) / scale).clamp(0, top).round().long()
    return (
        codes.reshape(b, h, t, d),
        scale.squeeze(-2 if axis == "channel" else -1),
        mn.squeeze(-2 if axis == "channel" else -1),
    )


def with_ties(x: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    """Plant exact half-way values: in the first group of every head, min 0 and max 2^B - 1 (scale 1)
    and every other value some k + 0.5, where half up and half to even disagree for even k."""
    x = x.clone()
    top = 2**bits - 1
    halves = (torch.arange(group * max(x.shape[-2], x.shape[-1])) % top).float() + 0.5
    if axis == "channel":
        block = halves[: group * x.shape[-1]].reshape(group, x.shape[-1])
        block[0], block[1] = 0.0, float(top)
        x[:, :, :group, :] = block.to(x.dtype)
    else:
        block = halves[: x.shape[-2] * group].reshape(x.shape[-2], group)
        block[:, 0], block[:, 1] = 0.0, float(top)
        x[:, :, :, :group] = block.to(x.dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quantizer_equals_the_released_arithmetic(dtype, bits, group, axis):
    torch.manual_seed(bits * group)
    x = with_ties((torch.randn(2, 3, 128, 128) * 3).to(dtype), bits, axis, group)
    codes, scale, zero = quantize_grouped(x, 2**bits, axis, group, arithmetic="kivi")
    want_codes, want_scale, want_mn = released(x, bits, group, axis)
    assert scale.dtype == dtype and zero.dtype == dtype  # parameters kept in the input's dtype
    assert torch.equal(codes.long(), want_codes)
    assert torch.equal(scale, want_scale) and torch.equal(zero, want_mn)
    # the planted ties are rounded half to even: kvbench's fp32 map (half up) differs on them
    fp32_codes, _, _ = quantize_grouped(x, 2**bits, axis, group, arithmetic="fp32")
    tie = (x.float() - want_mn.repeat_interleave(group, -2 if axis == "channel" else -1).float()) % 1 == 0.5
    assert tie.any() and not torch.equal(fp32_codes[tie].long(), want_codes[tie])


def test_constant_group_stays_clean():
    x = torch.randn(1, 1, 32, 32, dtype=torch.float16)
    x[..., :4] = 1.25  # every token: channels 0..3 constant over the key group
    codes, scale, zero = quantize_grouped(x, 4, "channel", 32, arithmetic="kivi")
    assert (codes[..., :4] == 0).all() and (scale[..., :4] == 0).all() and (zero[..., :4] == 1.25).all()
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()


@pytest.mark.parametrize("fp_dtype, dtype", [("float16", torch.float16), ("float32", torch.float32)])
@pytest.mark.parametrize("bits, group", [(2, 32), (4, 64)])
def test_kivi_layer_stores_the_released_codes_while_streaming(fp_dtype, dtype, bits, group):
    """Prefill then decode steps: every group the layer quantizes (when, is KIVI's streaming rule)
    holds the reference's codes, scale and minimum of the same full-precision tokens."""
    torch.manual_seed(7)
    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=128)
    method = build_method(
        {"name": "kivi", "bits": bits, "group_size": group, "residual": 2 * group, "fp_dtype": fp_dtype}
    )
    layer = method.new_cache(shape, torch.float32).layers[0]
    n = 5 * group + 3
    k = with_ties(torch.randn(1, 2, n, 128) * 2, bits, "channel", group)
    v = with_ties(torch.randn(1, 2, n, 128) * 2, bits, "token", group)
    layer.update(k[:, :, : 3 * group + 1], v[:, :, : 3 * group + 1])
    for t in range(3 * group + 1, n):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    for store, x, axis in ((layer.kq, k, "channel"), (layer.vq, v, "token")):
        held = len(store)
        assert held >= 2 * group
        want_codes, want_scale, want_mn = released(x[:, :, :held].to(dtype), bits, group, axis)
        assert store.scale.dtype == dtype and store.zero.dtype == dtype
        assert torch.equal(unpack(store.codes, store.levels, 128).long(), want_codes)
        assert torch.equal(store.scale, want_scale) and torch.equal(store.zero, want_mn)


def test_specache_zero_point_needs_the_fp32_arithmetic():
    with pytest.raises(ConfigError, match="method.zero_point"):
        build_method({"name": "kivi", "bits": 1, "zero_point": "specache"})
    method = build_method({"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32"})
    assert method.label() == "kivi-1b-specache0"  # (the specache zero point implies the fp32 map)
    assert build_method({"name": "kivi", "bits": 2, "arithmetic": "fp32"}).label() == "kivi-2b-fp32"
    assert build_method({"name": "kivi", "bits": 2}).label() == "kivi-2b"
    with pytest.raises(ConfigError, match="method.arithmetic"):
        build_method({"name": "kivi", "arithmetic": "exact"})
