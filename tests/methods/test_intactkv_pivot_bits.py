"""IntactKV's ``pivot_bits`` (kvbench/methods/intactkv.py): the pivot tokens' KV held as per-token
RTN codes, the paper's weight-activation setting (its Table 6), with the bytes held counted; null
(the default) is the FP16 pivot of every run made before the option.

The model is the tiny random Llama of tests/tiny_archs.py with 4-bit weights (groups of 32) and
4-bit activations (:mod:`kvbench.models.act_quant`); its unquantized twin is a deep copy taken
before. Caches keep the model's dtype (``fp_dtype: auto``) so that stored values compare exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_archs import plain_kv, prefilled, random_prompt, tiny_model

from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import KVLayer
from kvbench.cache.quantized import QuantizedTokens
from kvbench.cache.sink import SinkLayer
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.models.act_quant import fake_quantize_activations
from kvbench.models.weight_quant import fake_quantize_model
from kvbench.quant.affine import dequantize_grouped, quantize_grouped
from kvbench.results import run_id

TOKENS = 2
UNIFORM = {"name": "uniform", "group_size": 64}  # the tiny Llama's head_dim: one range per token


class _Empty(KVLayer):
    """A layer that never receives a token (the sink takes all)."""

    def append(self, keys, values):
        raise AssertionError("nothing should reach the inner layer")

    def read(self):
        raise AssertionError("nothing is stored in the inner layer")

    def held_tensors(self):
        return {}

    def stored(self):
        return None


def test_quantized_sink_holds_codes_and_dequantizes_by_hand():
    """One batch row, one head, two pivot tokens of D = 4 channels at 2 bits (levels 0..3):

    [0, 1, 2, 3]:       z = 0, s = 1; c = 0 1 2 3;               x' = 0 1 2 3
    [-1, .2, .9, 2]:    z = -1, s = 1; (x - z)/s + .5 = .5 1.7 2.4 3.5 -> c = 0 1 2 3; x' = -1 0 1 2
    values [4, 4, 4, 4] (no range: z = 4, s = 0, c = 0; x' = 4) and [0, 0, 0, 6] (z = 0, s = 2;
    c = 0 0 0 3; x' = 0 0 0 6).

    Held: the codes 4 x 2 bits = 1 byte a token, a float32 scale and zero a token (4 + 4 bytes),
    for keys and values: 2 * 2 * (1 + 8) = 36 bytes, all of it codes/scales/zeros, none "sink"."""
    layer = SinkLayer(_Empty(0), TOKENS, torch.float32)
    layer.hold_in(lambda: QuantizedTokens(4, "token", None, param_dtype=torch.float32))
    keys = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, 0.2, 0.9, 2.0]]).view(1, 1, 2, 4)
    values = torch.tensor([[4.0, 4.0, 4.0, 4.0], [0.0, 0.0, 0.0, 6.0]]).view(1, 1, 2, 4)
    layer.append(keys, values)
    k, v = layer.read()
    torch.testing.assert_close(
        k, torch.tensor([[0.0, 1, 2, 3], [-1, 0, 1, 2]]).view(1, 1, 2, 4), rtol=0, atol=0
    )
    torch.testing.assert_close(
        v, torch.tensor([[4.0, 4, 4, 4], [0, 0, 0, 6]]).view(1, 1, 2, 4), rtol=0, atol=0
    )
    held = layer.held_tensors()
    assert set(held) == {"codes", "scales", "zeros"}
    nbytes = {c: sum(t.numel() * t.element_size() for t in ts) for c, ts in held.items()}
    assert nbytes == {"codes": 2 * 2 * 1, "scales": 2 * 2 * 4, "zeros": 2 * 2 * 4}
    assert layer.quantized_values() == 2 * 2 * 4
    assert layer.nominal_code_bits() == 2 * 2 * 4 * 2
    # the codes themselves: 0 1 2 3 for both key tokens
    assert layer.sink_k.codes.shape == (1, 1, 2, 1)
    # attention reads the same through the stored sources
    stored = layer.stored()
    torch.testing.assert_close(stored.keys.read(0, 2), k, rtol=0, atol=0)
    torch.testing.assert_close(stored.values.read(0, 2), v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="before the sink holds any token"):
        layer.hold_in(lambda: QuantizedTokens(4, "token", None))


@pytest.fixture(scope="module")
def models():
    """``(w4a4, full, shape)``: the tiny Llama, RTN W4 (groups of 32) A4, and as built."""
    model, shape = tiny_model("llama")
    full = copy.deepcopy(model)
    fake_quantize_model(model, {"bits": 4, "group_size": 32})
    fake_quantize_activations(model, {"bits": 4})
    return model, full, shape


def node(pivot_bits=None, pivot="full_precision", base=UNIFORM) -> dict:
    out = {"name": "intactkv", "bits": 4, "tokens": TOKENS, "fp_dtype": "auto", "base": dict(base)}
    out["pivot"] = pivot
    if pivot_bits is not None:
        out["pivot_bits"] = pivot_bits
    return out


@torch.no_grad()
def test_pivot_bits_stores_the_full_precision_models_pivot_kv_as_per_token_codes(models):
    quantized, full, shape = models
    ids = random_prompt(24)
    runner, cache, logits = prefilled(quantized, shape, node(4), ids)
    assert runner.method.label() == "intactkv2fp-pivot4b-uniform-4b"
    _, fp_cache, fp_logits = prefilled(quantized, shape, node(None), ids)
    reference = plain_kv(full, ids[:, :TOKENS])  # the model as loaded: W16A16
    d = shape.head_dim
    for i in range(shape.num_layers):
        layer, fp_layer = cache.layers[i], fp_cache.layers[i]
        assert isinstance(layer.sink_k, QuantizedTokens) and isinstance(fp_layer.sink_k, FullPrecisionTokens)
        # the FP16 arm holds the loaded model's pivot KV; this one its 4-bit per-token RTN codes
        assert torch.equal(fp_layer.sink_k.data, reference.layers[i].keys)
        for store, exact in (
            (layer.sink_k, reference.layers[i].keys),
            (layer.sink_v, reference.layers[i].values),
        ):
            codes, scale, zero = quantize_grouped(exact, 16, "token", d, param_dtype=torch.float32)
            expected = dequantize_grouped(codes, scale, zero, "token", d)
            assert torch.equal(store.dequantize(), expected)
            assert store.codes.shape == (*exact.shape[:3], d // 2)  # two 4-bit codes a byte
            assert not torch.equal(expected, exact)
        k, _ = layer.read()
        assert torch.equal(k[:, :, :TOKENS], layer.sink_k.dequantize())
    # the accounting: FP16 arm's sink component replaced by codes/scales/zeros of D/2 + 2 * 4 bytes
    report, fp_report = cache.memory_report(), fp_cache.memory_report()
    entries = shape.num_layers * 2 * shape.num_kv_heads * TOKENS  # (layer, K/V, head, token)
    assert "sink" not in report.bytes_by_component
    assert fp_report.bytes_by_component["sink"] == entries * d * 4  # float32 (fp_dtype auto)
    for component, per_entry in (("codes", d // 2), ("scales", 4), ("zeros", 4)):
        delta = report.bytes_by_component[component] - fp_report.bytes_by_component[component]
        assert delta == entries * per_entry, component
    assert report.quantized_values == fp_report.quantized_values + entries * d
    assert report.total_bytes < fp_report.total_bytes
    assert not torch.allclose(logits, fp_logits, atol=1e-4)


def test_pivot_bits_null_is_the_run_of_before(models):
    """``pivot_bits`` absent or null: the same run id, label, cache layout and logits."""
    quantized, _, shape = models
    base = {"model": {"name": "tiny"}, "bits": 4, "seed": 0, "task": {"name": "perplexity"}}
    null = {**node(None), "pivot_bits": None}
    assert run_id({**base, "method": node(None)}) == run_id({**base, "method": null})
    assert run_id({**base, "method": node(4)}) != run_id({**base, "method": node(None)})
    assert build_method(null).label() == build_method(node(None)).label() == "intactkv2fp-uniform-4b"
    ids = random_prompt(20, seed=2)
    _, a, la = prefilled(quantized, shape, node(None), ids)
    _, b, lb = prefilled(quantized, shape, null, ids)
    assert torch.equal(la, lb)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert isinstance(x.sink_k, FullPrecisionTokens)
        assert all(torch.equal(p, q) for p, q in zip(x.read(), y.read(), strict=True))


def test_pivot_bits_with_pivot_model_quantizes_the_models_own_pivot(models):
    quantized, _, shape = models
    ids = random_prompt(20, seed=3)
    _, cache, _ = prefilled(quantized, shape, node(4, pivot="model"), ids)
    _, own, _ = prefilled(quantized, shape, node(None, pivot="model"), ids)
    d = shape.head_dim
    for layer, plain in zip(cache.layers, own.layers, strict=True):
        codes, scale, zero = quantize_grouped(plain.sink_k.data, 16, "token", d, param_dtype=torch.float32)
        torch.testing.assert_close(
            layer.sink_k.dequantize(),
            dequantize_grouped(codes, scale, zero, "token", d),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("value", [1, 9, 4.0, True, "4"])
def test_bad_pivot_bits_names_the_key_and_the_allowed_values(value):
    with pytest.raises(ConfigError, match=r"^method\.pivot_bits=.*(from 2 to 8|an integer|int)"):
        build_method(node(value))


def test_pivot_bits_refuses_a_cache_without_a_separate_sink(models, monkeypatch):
    """A base whose layers keep no :class:`SinkLayer` (none of the registered bases that take
    ``sink_tokens``; a sink kept inside a layer of the base's own) has nothing to quantize."""
    _, _, shape = models
    method = build_method(node(4))
    base = method.config.base_method
    plain = build_method({**UNIFORM, "bits": 4})
    monkeypatch.setattr(base, "new_cache", plain.new_cache)
    with pytest.raises(ConfigError, match=r"^method\.pivot_bits=4: null with base uniform"):
        method.new_cache(shape, torch.float32)
