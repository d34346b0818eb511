"""KIVI's layout and streaming rules against whole-tensor computations."""

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.methods import METHODS, ModelShape, build_method
from kvbench.quant.affine import fake_quantize_grouped

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


def kivi_layer(**overrides):
    method = build_method({"name": "kivi", "bits": 2, "fp_dtype": "auto", **overrides})
    method.config.check_model(SHAPE)
    return method.make_layer(0, SHAPE, torch.float32)


def feed(layer, keys, values, prefill):
    """Prefill ``prefill`` tokens at once, then decode the rest one token per update."""
    layer.update(keys[:, :, :prefill], values[:, :, :prefill])
    for t in range(prefill, keys.shape[2]):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])


def test_prefill_split_follows_r_equals_l_mod_R():
    k, v = torch.randn(2, 1, 2, 300, 64).unbind(0)
    layer = kivi_layer()
    layer.update(k, v)
    # keys: 300 mod 128 = 44 stay in the residual, 256 are quantized; values: the newest 128 stay.
    assert (len(layer.kq), len(layer.k_res)) == (256, 44)
    assert (len(layer.vq), len(layer.v_res)) == (172, 128)


def test_short_prefill_keeps_everything_in_full_precision():
    k, v = torch.randn(2, 1, 2, 100, 64).unbind(0)
    layer = kivi_layer()
    layer.update(k, v)
    assert (len(layer.kq), len(layer.k_res), len(layer.vq), len(layer.v_res)) == (0, 100, 0, 100)
    rk, rv = layer.read()
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_streaming_decode_equals_whole_tensor_requantization():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 500, 64) * torch.linspace(0.1, 4, 64)  # channel-dependent scales, like real keys
    v = torch.randn(1, 2, 500, 64)
    layer = kivi_layer()
    feed(layer, k, v, prefill=300)
    # After 300 + 200 tokens: keys flushed at 256 (prefill) and 384 (residual reached R=128), so 116
    # newest keys are in full precision; values keep the newest 128.
    assert (len(layer.kq), len(layer.k_res), len(layer.vq), len(layer.v_res)) == (384, 116, 372, 128)
    # KIVI's released arithmetic in the residual's dtype (float32 here: fp_dtype=auto, fp32 model)
    want_k = torch.cat(
        [fake_quantize_grouped(k[:, :, :384], 4, "channel", 32, arithmetic="kivi"), k[:, :, 384:]], 2
    )
    want_v = torch.cat(
        [fake_quantize_grouped(v[:, :, :372], 4, "token", 32, arithmetic="kivi"), v[:, :, 372:]], 2
    )
    got_k, got_v = layer.read()
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


def test_update_attends_stored_past_from_sources_and_new_tokens_exactly():
    k, v = torch.randn(2, 1, 2, 301, 64).unbind(0)
    layer = kivi_layer()
    layer.update(k[:, :, :300], v[:, :, :300])
    past_k, past_v = layer.read()
    keys, values = layer.update(k[:, :, 300:], v[:, :, 300:])
    # update returns this forward's exact tokens; the stored past is read from packed sources taken
    # before the append, which still read what was stored then
    assert torch.equal(keys, k[:, :, 300:]) and torch.equal(values, v[:, :, 300:])
    stored = layer.stored_for_attention
    # (float32 parameters: a block read's fused multiply-add may round the last bit differently)
    torch.testing.assert_close(stored.keys.read(0, 300), past_k.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stored.values.read(0, 300), past_v.float(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(past_k, k[:, :, :300])  # the quantized part is really quantized


def test_separate_key_and_value_bits():
    layer = kivi_layer(key_bits=4, value_bits=1.585)
    assert (layer.kq.levels, layer.vq.levels) == (16, 3)


def test_specache_zero_point_only_at_one_bit():
    one = kivi_layer(bits=1, zero_point="specache", arithmetic="fp32")
    two = kivi_layer(bits=2, zero_point="specache", arithmetic="fp32")
    assert one.kq.zero_point == "specache" and two.kq.zero_point == "minmax"


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"residual": 100}, "method.residual"),
        ({"residual": 0}, "method.residual"),
        ({"bits": 9}, "bits"),
        ({"bits": 2.1}, "bits"),
        ({"key_bits": 12}, "method.key_bits"),
        ({"value_bits": 0.5}, "method.value_bits"),
        ({"zero_point": "mean"}, "method.zero_point"),
        ({"colour": "red"}, "method.colour"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "kivi", "bits": 2, **overrides})
    assert str(err.value).startswith(f"{key}=")


def test_group_must_divide_head_dim():
    method = build_method({"name": "kivi", "bits": 2, "group_size": 48, "residual": 96})
    with pytest.raises(ConfigError, match=r"method.group_size=48: must divide head_dim=64"):
        method.config.check_model(SHAPE)


def test_unknown_method_lists_registered_ones():
    listed = ", ".join(sorted(METHODS.names()))
    with pytest.raises(ConfigError, match=rf"method.name='nope': registered methods are {listed}$"):
        build_method({"name": "nope"})
