"""Memory figures come from the tensors held, and match the analytic formulas."""

import math

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64)


def filled_cache(node, tokens, decode=0):
    method = build_method(node)
    method.config.check_model(SHAPE)
    cache = method.new_cache(SHAPE, torch.float32)
    k, v = torch.randn(2, 1, 3, tokens + decode, 64).unbind(0)
    for layer_idx in range(SHAPE.num_layers):
        cache.update(k[:, :, :tokens], v[:, :, :tokens], layer_idx)
        for t in range(tokens, tokens + decode):
            cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], layer_idx)
    return memory_report(cache.layers)


def test_kivi2_effective_bits_match_formula():
    # KIVI-2, G=32, R=128, T=4096 (a multiple of R): every key is quantized, the newest R values
    # stay in FP16. Per head and layer:
    #   keys   4096*64 codes at 2 bits + (4096/32)*64 (scale, zero) pairs in fp16
    #   values 3968*64 codes at 2 bits + 3968*(64/32) pairs in fp16 + 128*64 fp16 residual
    T, R, G, D = 4096, 128, 32, 64
    bits_per_head = T * D * 2 + (T // G) * D * 32 + (T - R) * D * 2 + (T - R) * (D // G) * 32 + R * D * 16
    want = bits_per_head / (2 * T * D)
    report = filled_cache({"name": "kivi", "bits": 2}, T)
    assert report.effective_bits == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(3.203125)
    assert report.code_bits == 2.0
    assert report.nominal_code_bits == 2.0
    assert report.n_values == 2 * 2 * 3 * T * D
    assert report.bytes_by_component["residual"] == 2 * 3 * R * D * 2
    assert report.compression == pytest.approx(16 / want)


def test_fractional_bits_are_packed_base_L():
    # 5 levels: ten codes in a 3-byte word -> 64 codes in 7 words, 2.625 code bits (2.4 in full
    # words); per-token groups of 32 add 1 bit of params.
    report = filled_cache({"name": "uniform", "bits": 2.322}, 96)
    assert report.code_bits == pytest.approx(8 * 3 * math.ceil(64 / 10) / 64)
    assert report.nominal_code_bits == pytest.approx(math.log2(5))
    assert report.effective_bits == pytest.approx(report.code_bits + 1.0)


@pytest.mark.parametrize(
    "node",
    [
        {"name": "uniform", "bits": 2},
        {"name": "uniform", "bits": 1.585, "key_axis": "channel"},
        {"name": "kivi", "bits": 2},
        {"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32"},
    ],
)
def test_quantizing_methods_hold_less_than_fp16(node):
    report = filled_cache(node, 600, decode=5)
    fp16 = filled_cache({"name": "fp16"}, 600, decode=5)
    assert fp16.effective_bits == 16.0 and fp16.total_bytes == fp16.fp16_bytes
    assert report.total_bytes < 0.35 * fp16.total_bytes
    assert report.tokens == 605


def test_host_and_prefetch_hooks_are_declared_with_defaults():
    """Every layer answers the two offload hooks: a layer that keeps nothing on the host reports no
    host bytes and no prefetch; a sink wrapper passes its inner layer's answers on."""
    from kvbench.cache.fp import FullPrecisionTokens
    from kvbench.cache.layer import KVLayer
    from kvbench.cache.sink import SinkLayer

    class Offloading(KVLayer):
        def __init__(self):
            super().__init__(0)
            self.host = FullPrecisionTokens(torch.float16)

        def append(self, keys, values):
            self.host.append(keys)

        def read(self):
            return self.host.data, self.host.data

        def held_tensors(self):
            return {}

        def host_tensors(self):
            return {"host_fp": self.host.tensors()}

        def prefetch_stats(self):
            return 3, 12, 96

    plain = filled_cache({"name": "kivi", "bits": 2}, 64)
    assert plain.host_bytes == 0 and plain.prefetch_steps == 0 and plain.prefetch_bytes_per_step is None
    for layer in (Offloading(), SinkLayer(Offloading(), 1, torch.float16)):
        layer.update(*torch.randn(2, 1, 3, 5, 64).unbind(0))
        report = memory_report([layer])
        host_tokens = 5 if isinstance(layer, Offloading) else 4  # the sink keeps the first token
        assert report.host_bytes == 3 * host_tokens * 64 * 2
        assert report.prefetch_steps == 3 and report.prefetch_bytes_per_step == 32
