"""IntactKV / sink tokens: the first k tokens are held exactly, the rest by the base method."""

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


def fill(node, k, v, steps):
    """Feed ``k, v [1, 2, T, 64]`` in the given chunk sizes; return the cache's only layer."""
    cache = build_method(node).new_cache(SHAPE, torch.float32)
    start, returned = 0, None
    for n in steps:
        returned = cache.update(k[:, :, start : start + n], v[:, :, start : start + n], 0)
        start += n
    return cache.layers[0], returned


def test_sink_tokens_are_exact_and_first():
    k, v = torch.randn(2, 1, 2, 40, 64).unbind(0)
    node = {"name": "uniform", "bits": 1, "sink_tokens": 4, "fp_dtype": "auto"}
    layer, _ = fill(node, k, v, [2, 1, 30, 1, 1, 5])  # the sink fills across three updates
    rk, rv = layer.read()
    assert torch.equal(rk[:, :, :4], k[:, :, :4]) and torch.equal(rv[:, :, :4], v[:, :, :4])
    plain, _ = fill({"name": "uniform", "bits": 1, "fp_dtype": "auto"}, k[:, :, 4:], v[:, :, 4:], [36])
    assert torch.equal(rk[:, :, 4:], plain.read()[0])  # the rest is exactly what the base stores
    assert len(layer.inner.kq) == 36 and layer.num_tokens == 40


def test_update_stores_sink_first_and_attends_past_from_sources():
    k, v = torch.randn(2, 1, 2, 21, 64).unbind(0)
    layer, (keys, values) = fill({"name": "kivi", "bits": 2, "residual": 32, "sink_tokens": 1}, k, v, [20, 1])
    assert torch.equal(keys, k[:, :, -1:])  # this forward's token, exact
    stored = layer.stored_for_attention  # the 20 tokens stored before it: fp16 sink, then KIVI's stores
    assert stored.num_entries == 20 and stored.positions is None
    assert torch.equal(stored.keys.read(0, 1), k[:, :, :1].half().float())
    assert torch.equal(stored.keys.read(1, 20), layer.inner.read()[0][:, :, :19].float())


def test_sink_bytes_are_counted():
    k, v = torch.randn(2, 1, 2, 100, 64).unbind(0)
    with_sink, _ = fill({"name": "uniform", "bits": 2, "sink_tokens": 3}, k, v, [100])
    report = memory_report([with_sink])
    assert report.bytes_by_component["sink"] == 2 * (1 * 2 * 3 * 64) * 2  # K and V, fp16
    assert report.quantized_values == 2 * 2 * 97 * 64


def test_intactkv_is_its_base_with_a_lossless_prefix():
    k, v = torch.randn(2, 1, 2, 300, 64).unbind(0)
    a, _ = fill({"name": "intactkv", "bits": 2, "tokens": 2, "base": {"name": "kivi"}}, k, v, [300])
    b, _ = fill({"name": "kivi", "bits": 2, "sink_tokens": 2}, k, v, [300])
    for x, y in zip(a.read(), b.read(), strict=True):
        assert torch.equal(x, y)
    assert build_method({"name": "intactkv", "bits": 2, "tokens": 2}).label() == "intactkv2-kivi-2b"


@pytest.mark.parametrize(
    "node, key",
    [
        ({"name": "intactkv", "tokens": 0}, "method.tokens"),
        ({"name": "intactkv", "base": {"name": "intactkv"}}, "method.base.name"),
        ({"name": "kivi", "sink_tokens": -1}, "method.sink_tokens"),
    ],
)
def test_bad_config(node, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        build_method(node)
