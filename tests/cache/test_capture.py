"""The capture facility: attention records through the kvbench attention function (with and without
a kvbench cache), output hooks, and replaying captured tensors through a method's layer."""

import pytest
import torch

from kvbench.cache import use_kvbench_attention
from kvbench.cache.capture import OutputCapture, active_capture, capture_attention, replay
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    use_kvbench_attention(model)
    return model


@torch.no_grad()
def test_attention_records_what_the_cache_returned_and_only_inside_the_block(tiny):
    ids = torch.randint(0, 40, (1, 12))
    exact = build_method({"name": "fp16", "fp_dtype": "auto"})
    cache = exact.new_cache(SHAPE, torch.float32)
    with capture_attention([1]) as cap:
        tiny(input_ids=ids[:, :10], **cache.forward_kwargs())
        assert active_capture() is cap
    assert active_capture() is None and set(cap.records) == {1}
    rec = cap.records[1]
    assert rec.query.shape == (1, 4, 10, 8) and rec.keys.shape == (1, 2, 10, 8)
    assert rec.scaling == pytest.approx(8**-0.5)
    stored_k, stored_v = cache.layers[1].read()
    assert torch.equal(rec.keys, stored_k) and torch.equal(rec.values, stored_v)
    # a decode step: the cache returns the new token only (the 10 stored ones are attended from
    # storage, blockwise), and that is what is recorded
    with capture_attention() as step:
        tiny(input_ids=ids[:, 10:11], **cache.forward_kwargs())
    assert step.records[0].query.shape == (1, 4, 1, 8) and step.records[1].keys.shape == (1, 2, 1, 8)
    assert torch.equal(step.records[1].keys, cache.layers[1].read()[0][:, :, 10:].float())
    # without a kvbench cache the forward's own states are recorded: the same prompt, the same keys
    with capture_attention() as plain:
        tiny(input_ids=ids[:, :10], use_cache=False)
    assert torch.allclose(plain.records[1].keys, rec.keys) and torch.allclose(
        plain.records[1].query, rec.query
    )


@torch.no_grad()
def test_output_capture_keeps_the_reduced_output_until_closed(tiny):
    layers = [m for name, m in tiny.named_modules() if name.endswith("self_attn.k_proj")]
    ids = torch.randint(0, 40, (1, 5))
    with OutputCapture(layers, lambda args, kwargs, out: out.shape[1] * 100 + out.shape[-1]) as cap:
        tiny(input_ids=ids, use_cache=False)
        assert cap.records == {0: 516, 1: 516}  # 5 tokens, 2 kv heads x 8 channels
    cap.records.clear()
    tiny(input_ids=ids, use_cache=False)
    assert cap.records == {} and cap.handles == []


def test_replay_drives_a_layer_as_a_decode_would():
    """Replaying through the exact layer gives exact causal attention at every decode step; through
    h2o it also runs the eviction (the budget holds after every step)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    layer = build_method({"name": "fp16", "fp_dtype": "auto"}).new_cache(SHAPE, torch.float32).layers[0]
    outs = replay(layer, q, k, v, prefill=15, steps=5, scaling=0.3)
    for t, out in zip(range(15, 20), outs, strict=True):
        kr, vr = k[:, :, : t + 1].repeat_interleave(2, 1), v[:, :, : t + 1].repeat_interleave(2, 1)
        want = torch.softmax(q[:, :, t : t + 1] @ kr.transpose(-1, -2) * 0.3, -1) @ vr  # [1, H, 1, D]
        assert torch.allclose(out.transpose(1, 2), want, atol=1e-5)
    h2o = (
        build_method({"name": "h2o", "budget": 6, "fp_dtype": "auto"})
        .new_cache(SHAPE, torch.float32)
        .layers[0]
    )
    kept = []
    replay(
        h2o, q, k, v, 15, 5, 0.3, attend_prefill=True, before_attend=lambda t, layer: kept.append(layer.kept)
    )
    assert kept == [7] * 5 and h2o.kept == 6  # the budget, plus the token being attended
