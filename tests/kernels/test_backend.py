"""``backend=triton`` holds the same bytes and reads the same values as ``backend=torch``."""

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=64)


def filled_layer(node, k, v, prefill):
    method = build_method(node)
    layer = method.make_layer(0, SHAPE, torch.float32)
    layer.update(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, k.shape[2]):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    return layer


@pytest.mark.parametrize(
    "node",
    [
        {"name": "kivi", "bits": 2, "residual": 64},
        {"name": "kivi", "bits": 1, "zero_point": "specache", "residual": 32},
        {"name": "uniform", "bits": 2.322, "key_axis": "channel"},
    ],
)
def test_triton_backend_matches_torch(node):
    k = torch.randn(1, 2, 203, 64) * torch.rand(64) * 4
    v = torch.randn(1, 2, 203, 64)
    ref = filled_layer(node, k, v, prefill=170)
    tri = filled_layer({**node, "backend": "triton"}, k, v, prefill=170)
    for a, b in zip(ref.held_tensors().values(), tri.held_tensors().values(), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for x, y in zip(ref.read(), tri.read(), strict=True):
        assert torch.equal(x, y)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"method.backend='triton': needs a CUDA device"):
        build_method({"name": "kivi", "bits": 2, "backend": "triton"})
