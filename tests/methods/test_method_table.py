"""Checks every registered method must pass; the methods come from the registry, so a new method is
checked without touching this file (its class may adjust the node and error bound it is checked with).

Per method: its config node, whether it quantizes (its cache must then be smaller than FP16), and
the largest relative reconstruction error allowed on Gaussian keys/values.
"""

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.methods import METHODS, ModelShape, build_method


def contract(name: str) -> tuple[dict, bool, float]:
    """(node, whether it quantizes, largest relative reconstruction error) of a registered method,
    from what its class declares (``Method.contract_node``/``contract_error``): a method quantizes
    when the run's ``bits`` applies to it, and must then hold less than FP16; the others are lossless
    here."""
    cls = METHODS.get(name)
    node = {"name": name, **cls.contract_node}
    quantizes = build_method(node).config.bits is not None
    return node, quantizes, cls.contract_error if quantizes else 1e-3


SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def test_the_contract_covers_the_baselines_and_the_quantizers():
    quantizing = {name for name in METHODS.names() if contract(name)[1]}
    assert {"kivi", "uniform", "semkv", "kvquant"} <= quantizing
    assert not {"fp16", "h2o", "snapkv"} & quantizing


@pytest.mark.parametrize("name", METHODS.names())
def test_method_contract(name):
    node, quantizes, max_rel_err = contract(name)
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
        # the cache returns the new token alone when the stored ones are attended from packed
        # storage (tests/cache/test_attend_packed.py), else everything it attends
        assert keys.shape[-2] in (1, prefill + decode) and keys.shape[:2] == (1, 2)
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
