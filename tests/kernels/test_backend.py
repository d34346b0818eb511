"""``backend=triton`` holds the same bytes and reads the same values as ``backend=torch``: the Triton
kernels (quantize_pack for appends, TritonReader and KIVI's fused decode for reads) against the
torch reference."""

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=6, num_kv_heads=2, head_dim=64)
BACKENDS = ("torch", "triton")


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
        {"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32", "residual": 32},
        {"name": "uniform", "bits": 2.322, "key_axis": "channel"},
    ],
)
def test_triton_backend_matches_torch(node, monkeypatch):
    from kvbench.kernels import quant_pack

    launched = []

    def spy(*args, **kwargs):
        launched.append(args[1:4])
        return quantize_pack(*args, **kwargs)

    quantize_pack = quant_pack.quantize_pack
    monkeypatch.setattr(quant_pack, "quantize_pack", spy)
    k = torch.randn(1, 2, 203, 64) * torch.rand(64) * 4
    v = torch.randn(1, 2, 203, 64)
    ref = filled_layer(node, k, v, prefill=170)
    assert not launched  # the torch backend never reaches a kernel
    tri = filled_layer({**node, "backend": "triton"}, k, v, prefill=170)
    # kvbench's fp32 arithmetic is packed by the Triton kernel; KIVI's released one only by torch
    assert bool(launched) == (node.get("arithmetic", "kivi" if node["name"] == "kivi" else "fp32") == "fp32")
    for a, b in zip(ref.held_tensors().values(), tri.held_tensors().values(), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for x, y in zip(ref.read(), tri.read(), strict=True):
        assert torch.equal(x, y)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"method.backend='triton': needs a CUDA device"):
        build_method({"name": "kivi", "bits": 2, "backend": "triton"})


class FakeAttention(torch.nn.Module):
    """What transformers' SDPA path reads from an attention module."""

    num_key_value_groups = 3
    scaling = 64**-0.5
    is_causal = True
    training = False


@pytest.mark.parametrize("bits", [2, 1.585])
def test_fused_decode_attention_in_kivi_matches_torch_path(bits):
    node = {"name": "kivi", "bits": bits, "residual": 32, "fp_dtype": "float16"}
    torch_layer = build_method(node).make_layer(0, SHAPE, torch.float32)
    triton_layer = build_method({**node, "backend": "triton"}).make_layer(0, SHAPE, torch.float32)
    k = torch.randn(1, 2, 150, 64) * torch.rand(64) * 3
    v = torch.randn(1, 2, 150, 64)
    for layer in (torch_layer, triton_layer):
        layer.update(k[:, :, :100], v[:, :, :100])
    module = FakeAttention()
    for t in range(100, 150):  # crosses a key flush at 128 tokens
        q = torch.randn(1, 6, 1, 64)
        outs = []
        for layer in (torch_layer, triton_layer):
            keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(layer.attend(module, q, keys, values, None, scaling=module.scaling)[0])
        assert outs[0].shape == outs[1].shape == (1, 1, 6, 64)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    assert len(triton_layer.kq) == 128  # the flush really happened on the fused path


def test_kivi_triton_generation_matches_torch(default_model):
    from kvbench.generate import ModelRunner

    model, tokenizer, shape = default_model
    ids = tokenizer("The history of Paris begins in the third century BC when", return_tensors="pt")
    ids = torch.cat([ids.input_ids] * 4, dim=1)  # ~50 tokens: past the G=R=32 flush
    node = {"name": "kivi", "bits": 2, "residual": 32}
    want = ModelRunner(model, tokenizer, build_method(node), shape).generate(ids, 6)
    got = ModelRunner(model, tokenizer, build_method({**node, "backend": "triton"}), shape).generate(ids, 6)
    assert got.token_ids == want.token_ids
    assert got.memory.to_dict() == want.memory.to_dict()


@pytest.mark.parametrize(
    "node",
    [
        {"name": "uniform", "bits": 2.322, "key_axis": "channel", "group_size": 16},
        {"name": "ott", "bits": 2, "group_size": 32, "residual": 16, "skip_layers": 0},
        {"name": "turboquant", "bits": 3, "residual": 8},
    ],
)
def test_triton_part_reader_in_a_layer_matches_torch(node):
    """A decode step's attention read through TritonReader (``attend``) equals the torch reference's."""
    from kvbench.kernels import cpu

    k = torch.randn(1, 2, 140, 64) * torch.rand(64) * 3
    v = torch.randn(1, 2, 140, 64)
    # build_layers sets each layer's read backend (make_layer alone leaves the default)
    layers = [build_method({**node, "backend": b}).build_layers(SHAPE, torch.float32)[0] for b in BACKENDS]
    for layer in layers:
        layer.update(k[:, :, :130], v[:, :, :130])
    module = FakeAttention()
    for t in range(130, 133):
        q = torch.randn(1, 6, 1, 64)
        outs = []
        for layer in layers:
            cpu.reset_for_tests()
            keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(layer.attend(module, q, keys, values, None, scaling=module.scaling)[0])
        assert cpu.backend_in_use() == "triton"  # the triton layer's reads, all of them
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)


def test_kivi_triton_step_with_a_mask_reads_the_parts_through_triton():
    """A padded step, which the fused kernel does not take, reads the stored parts through
    TritonReader with the mask (no torch reconstruction), and equals the torch path."""
    from kvbench.kernels import cpu

    node = {"name": "kivi", "bits": 3, "residual": 32}
    layers = [build_method({**node, "backend": b}).build_layers(SHAPE, torch.float32)[0] for b in BACKENDS]
    k = torch.randn(1, 2, 120, 64) * torch.rand(64) * 3
    v = torch.randn(1, 2, 120, 64)
    for layer in layers:
        layer.update(k[:, :, :118], v[:, :, :118])
    module = FakeAttention()
    for t in (118, 119):
        q = torch.randn(1, 6, 1, 64)
        mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
        mask[..., :5] = False  # five padding tokens at the start
        outs = []
        for layer in layers:
            cpu.reset_for_tests()
            keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(layer.attend(module, q, keys, values, mask, scaling=module.scaling)[0])
        assert cpu.backend_in_use() == "triton"
        torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
