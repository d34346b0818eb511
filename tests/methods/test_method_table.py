"""Checks every method must pass. Adding a method adds one row to ``METHOD_TABLE``.

Each row: the method's config node, whether it quantizes (its cache must then be smaller than
FP16), and the largest relative reconstruction error allowed on Gaussian keys/values.
"""

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.methods import METHODS, ModelShape, build_method

METHOD_TABLE = {
    "fp16": ({"name": "fp16"}, False, 1e-3),
    "uniform": ({"name": "uniform", "bits": 2}, True, 0.5),
    "kivi": ({"name": "kivi", "bits": 2}, True, 0.5),
    "intactkv": ({"name": "intactkv", "bits": 2, "tokens": 1}, True, 0.5),
    "turboquant": ({"name": "turboquant", "bits": 2}, True, 0.5),
    "ott": ({"name": "ott", "bits": 2}, True, 0.5),
    # the table shape has no rope_theta and no model to calibrate on: post-RoPE, prompt statistics
    "kvquant": ({"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": False}, True, 0.6),
    # 6 stored bits: 8 + fp16 params (1 bit at G = 32) would not fit the shared < FP16/2 check
    "readkv": ({"name": "readkv", "bits": 6, "read_bits": 3}, True, 0.2),
    # key_norm is scored at append time, so the prefill is allocated without after_forward;
    # the 40 decode tokens stay pending (under one 64-token chunk)
    "semkv": ({"name": "semkv", "metric": "key_norm"}, True, 0.5),
    # the accelerator's low-bit copy is what read() returns; the FP16 host copy is not device memory
    "specache": ({"name": "specache", "bits": 2}, True, 0.5),
    # eviction: the contract reads every token back, so the budget exceeds its 340 tokens (nothing is
    # evicted, FP16 bytes); what the policies keep is tested in test_eviction.py
    "streamingllm": ({"name": "streamingllm", "budget": 512}, False, 1e-3),
    "h2o": ({"name": "h2o", "budget": 512}, False, 1e-3),
    "snapkv": ({"name": "snapkv", "budget": 512}, False, 1e-3),
    "random_prune": ({"name": "random_prune", "budget": 512}, False, 1e-3),
}

SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def test_every_registered_method_has_a_row():
    assert set(METHODS.names()) == set(METHOD_TABLE)


@pytest.mark.parametrize("name", sorted(METHOD_TABLE))
def test_method_contract(name):
    node, quantizes, max_rel_err = METHOD_TABLE[name]
    method = build_method(node)
    method.config.check_model(SHAPE)
    cache = method.new_cache(SHAPE, torch.float32)
    prefill, decode = 300, 40
    k, v = torch.randn(2, 1, 2, prefill + decode, 64).unbind(0)
    for layer in range(SHAPE.num_layers):
        keys, values = cache.update(k[:, :, :prefill], v[:, :, :prefill], layer)
        # Prefill attends the exact states just computed.
        assert torch.equal(keys, k[:, :, :prefill]) and torch.equal(values, v[:, :, :prefill])
        for t in range(prefill, prefill + decode):
            keys, values = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], layer)
        assert keys.shape == (1, 2, prefill + decode, 64)
        assert torch.equal(keys[:, :, -1], k[:, :, -1])  # the newest token is attended exactly
    assert cache.get_seq_length(0) == prefill + decode
    stored_k, stored_v = cache.layers[0].read()
    err = max((stored_k.float() - k).norm() / k.norm(), (stored_v.float() - v).norm() / v.norm())
    assert err <= max_rel_err
    report = memory_report(cache.layers)
    assert report.tokens == prefill + decode
    if quantizes:
        assert report.total_bytes < report.fp16_bytes / 2  # short context: the FP16 residual weighs
        assert report.quantized_values > 0
        assert err > 1e-3  # it really changed the values
    else:
        assert report.total_bytes == report.fp16_bytes
